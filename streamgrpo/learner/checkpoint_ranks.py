"""Asynchronous checkpoints of DeepSpeed ranks (one or many): each rank copies its part, writes it in the background.

At the checkpoint's step boundary every rank (:func:`capture`, the stall): rank 0 creates ``step-N.tmp`` and
copies the model's weights (ZeRO-3: gathers them, a collective) and the learner state; every rank runs
DeepSpeed's own ``save_checkpoint`` with :class:`~streamgrpo.learner.checkpoint.SafeTensorsCheckpointEngine`
capturing, so each state tree this rank would write (its module states, its ZeRO optimizer shard) is copied
into this rank's host buffers (pinned and reused when on a GPU:
:class:`~streamgrpo.learner.checkpoint_async.HostBuffers`) instead of being written, and its RNG states are
copied. DeepSpeed's collectives in ``save_checkpoint`` run here, in the training thread, on every rank alike.

Then a background thread on every rank (:func:`write_rank`) writes this rank's files under their usual names
and fsyncs them; it does *not* rename. The ranks agree at step boundaries
(:class:`~streamgrpo.learner.checkpointing.Checkpointing`): once every rank's files are durable, rank 0 renames
``step-N.tmp`` to ``step-N`` (:func:`finalise`), and only then does each rank commit its groups in Redis. The
files are the same as a synchronous DeepSpeed checkpoint's, so loading (and resharding) is unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamgrpo.learner.checkpoint import (
    commit_checkpoint,
    fsync_path,
    rng_state,
    staging_dir,
    write_trainer_state,
    write_tree,
)
from streamgrpo.learner.checkpoint_async import HostBuffers
from streamgrpo.learner.distributed import barrier


@dataclass
class RankSnapshot:
    """One DeepSpeed rank's part of a checkpoint in host memory (rank 0 also holds the model and the meta)."""

    step: int
    tmp: Path
    trees: list[tuple[str, dict[str, torch.Tensor], Any]]
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]]
    weights: dict[str, torch.Tensor] | None = None
    meta: dict[str, Any] | None = None
    model_card: str | None = None


def capture(learner, root: str | Path, meta: dict[str, Any], model_card: str | None) -> RankSnapshot:
    """This rank's part of checkpoint ``learner.state.step`` as host copies (every rank calls it: collectives)."""
    dist, step = learner.dist, learner.state.step
    tmp = Path(root) / f"step-{step:06d}.tmp"
    if dist.is_main:
        staging_dir(root, step)
    barrier(dist)
    host = learner.__dict__.setdefault("_host_buffers", HostBuffers())
    gathered = learner.policy_tensors() if learner.zero_stage >= 3 else None  # ZeRO-3: collective, CPU copies
    weights = None
    if dist.is_main:
        weights = gathered if gathered is not None else host.copy(learner.saved_weights(), prefix="model/")
    engine = learner.engine.checkpoint_engine
    engine.capturing(host)
    try:
        learner.engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", exclude_frozen_parameters=True)
    finally:
        trees = engine.captures()
    rng_tensors, rng_meta = rng_state()
    return RankSnapshot(step=step, tmp=tmp, trees=trees, rng=({k: v.clone() for k, v in rng_tensors.items()}, rng_meta),
                        weights=weights, meta={**meta, "step": step} if dist.is_main else None,
                        model_card=model_card if dist.is_main else None)


def write_rank(learner, snap: RankSnapshot) -> Path:
    """Write this rank's part of ``snap`` into ``step-N.tmp`` and fsync it (any thread; no collective, no rename)."""
    from safetensors.torch import save_file

    rank, tmp = learner.dist.rank, snap.tmp
    written: list[Path] = []
    if snap.weights is not None:  # rank 0
        learner.module.save_pretrained(tmp, state_dict=snap.weights, safe_serialization=True)
        learner.processor.save_pretrained(tmp)
        if snap.model_card:
            (tmp / "README.md").write_text(snap.model_card)
        write_trainer_state(tmp, snap.meta or {})
    save_file(snap.rng[0], str(tmp / f"rng-rank{rank}.safetensors"))
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(snap.rng[1]))
    written += [tmp / f"rng-rank{rank}.safetensors", tmp / f"rng-rank{rank}.json"]
    for path, tensors, skeleton in snap.trees:
        write_tree(tensors, skeleton, path)
        written.append(Path(path))
    if snap.weights is not None:
        fsync_written_tree(tmp)  # rank 0: what it wrote (save_pretrained's names), and the folders
    else:
        for path in written:
            fsync_path(path)
    return tmp  # the folders again, with every rank's files in them: finalise()


def fsync_written_tree(folder: Path) -> None:
    """Rank 0's :func:`~streamgrpo.learner.checkpoint.fsync_tree` while other ranks still write into ``folder``:
    a file listed and then gone (another rank's ``*.tmp``, renamed into place by :func:`write_tree`) is that
    rank's to fsync; :func:`finalise` fsyncs the whole tree once every rank is done, before the rename."""
    for dirpath, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            try:
                fsync_path(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
        fsync_path(dirpath)


def finalise(root: str | Path, step: int, total_limit: int | None) -> Path:
    """Rank 0, once every rank's part is durable: fsync, rename ``step-N.tmp`` to ``step-N``, prune."""
    return commit_checkpoint(root, step, total_limit)
