"""Asynchronous checkpoints of DeepSpeed ranks (one or many): each rank copies its part, writes it in the background.

At the checkpoint's step boundary every rank (:func:`capture`, the stall): rank 0 creates ``step-N.tmp`` and
copies the model's weights into its reused host buffers (ZeRO-3: gathers them bucket by bucket, a collective,
copying each bucket as it comes) and the learner state; every rank runs
DeepSpeed's own ``save_checkpoint`` with :class:`~streamgrpo.learner.checkpoint.files.SafeTensorsCheckpointEngine`
capturing, so each state tree this rank would write (its module states, its ZeRO optimizer shard) is copied
into this rank's host buffers (pinned and reused when on a GPU:
:class:`~streamgrpo.learner.checkpoint.background.HostBuffers`) instead of being written, and its RNG states are
copied. DeepSpeed's collectives in ``save_checkpoint`` run here, in the training thread, on every rank alike.

Then a background thread on every rank (:func:`write_rank`) writes this rank's files under their usual names
and fsyncs them; it does *not* rename. The ranks agree at step boundaries
(:class:`~streamgrpo.learner.checkpoint.commit.Checkpointing`): once every rank's files are durable, rank 0 renames
``step-N.tmp`` to ``step-N`` (:func:`finalise`), and only then does each rank commit its groups in Redis. The
files are the same as a synchronous DeepSpeed checkpoint's, so loading (and resharding) is unchanged.

A part that fails on one rank (rank 0 cannot create ``step-N.tmp``: a full disk, a permission, a stale folder
it cannot remove; a host copy or a write of one rank fails) must not leave the other ranks waiting in the next
collective until the process group's timeout: each rank-local part runs to its end keeping its error, and the
ranks then agree (:func:`parts_agree`, one all-reduce of an ok flag, where a bare barrier stood). On a failure
every rank raises the same one line naming the first failing rank, after rank 0, and only rank 0, has removed
the shared ``step-N.tmp``; nothing is committed. The synchronous checkpoint of DeepSpeed ranks
(:func:`save_ranks`) agrees the same way at each of its steps: before DeepSpeed's ``save_checkpoint`` (whose
collectives every rank must reach), after it, and after rank 0's rename.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamgrpo.learner.checkpoint.background import HostBuffers, first_failure
from streamgrpo.learner.checkpoint.files import (
    CheckpointWriteError,
    commit_checkpoint,
    fsync_path,
    rng_state,
    save_rank_rng,
    staging_dir,
    write_failure,
    write_trainer_state,
    write_tree,
)
from streamgrpo.learner.distributed import DistInfo, gather_json, share

LATEST = "state"
"""The tag of DeepSpeed's files in ``step-N/deepspeed/`` (and the content of its ``latest`` file)."""


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


def part(run: Callable[[], Any]) -> Exception | None:
    """Run a rank-local part of a checkpoint (no collective in it): its error, None when it succeeded."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - told to every rank by parts_agree, then raised
        return exc
    return None


def parts_agree(dist: DistInfo, root: str | Path, step: int, error: BaseException | None) -> None:
    """Every rank, after a rank-local part of checkpoint ``step``: return when it succeeded on every rank (one
    all-reduce of an ok flag); else rank 0 removes ``step-N.tmp`` (no rank writes into it any more) and every
    rank raises the first failing rank's one line (:class:`~streamgrpo.learner.checkpoint.files.CheckpointWriteError`;
    a failure that is no write error, a bug, is raised with its own traceback on its rank)."""
    if not share(dist, [0.0 if error is None else 1.0])[:, 0].any():
        return
    fail_together(dist, root, step, error)


def fail_together(dist: DistInfo, root: str | Path, step: int, error: BaseException | None) -> None:
    """Every rank, once they know checkpoint ``step`` failed on some rank and none writes into ``step-N.tmp`` any
    more: rank 0 removes it and every rank raises the first failing rank's one line (``error``: this rank's, None
    where its part succeeded; one that is no write failure, a bug, is raised with its own traceback here)."""
    mine = None if error is None else (write_failure(error, root, step) or error)
    lines = gather_json(dist, "" if mine is None else (str(mine) or type(mine).__name__))
    if dist.is_main:
        shutil.rmtree(Path(root) / f"step-{step:06d}.tmp", ignore_errors=True)
    if error is not None and not isinstance(mine, CheckpointWriteError):
        raise error
    raise CheckpointWriteError(first_failure(lines))


def capture(learner, root: str | Path, meta: dict[str, Any], model_card: str | None) -> RankSnapshot:
    """This rank's part of checkpoint ``learner.state.step`` as host copies (every rank calls it: collectives).
    Writes only folders (and DeepSpeed's recovery scripts); a part that fails on any rank raises on every rank."""
    dist, step = learner.dist, learner.state.step
    tmp = Path(root) / f"step-{step:06d}.tmp"
    parts_agree(dist, root, step, part(lambda: staging_dir(root, step)) if dist.is_main else None)
    host = learner.__dict__.setdefault("_host_buffers", HostBuffers())
    failed: list[Exception] = []  # rank 0's copy of the weights; every rank must still reach the collectives

    def into_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not failed:
            try:
                return host.copy(tensors, prefix="model/")
            except Exception as exc:  # noqa: BLE001 - told to every rank by parts_agree
                failed.append(exc)
        return {}

    weights: dict[str, torch.Tensor] | None = None
    if learner.zero_stage >= 3:  # a collective: rank 0 copies each gathered bucket into the reused buffers
        weights = learner.policy_tensors(copy=into_host)
    elif dist.is_main:
        weights = into_host(learner.saved_weights())
    engine = learner.engine.checkpoint_engine
    engine.capturing(host, failed[0] if failed else None)
    try:
        learner.engine.save_checkpoint(str(tmp / "deepspeed"), tag=LATEST, save_latest=False,
                                       exclude_frozen_parameters=True)
    finally:
        trees = engine.captures()
    parts_agree(dist, root, step, engine.failed)
    rng_tensors, rng_meta = rng_state()
    return RankSnapshot(step=step, tmp=tmp, trees=trees, rng=({k: v.clone() for k, v in rng_tensors.items()}, rng_meta),
                        weights=weights, meta={**meta, "step": step} if dist.is_main else None,
                        model_card=model_card if dist.is_main else None)


def save_ranks(learner, root: str | Path, meta: dict[str, Any], model_card: str | None) -> Path:
    """The synchronous checkpoint of DeepSpeed ranks (every rank calls it): write every rank's part, fsync, rename.
    Each rank's files are its own; only rank 0 creates, removes or renames the shared ``step-N.tmp``, and only
    once every rank has said how its part went (:func:`parts_agree`): a part that fails on one rank raises the
    same line on every rank and leaves no ``step-N`` (the previous checkpoint stays the newest)."""
    dist, step, root = learner.dist, learner.state.step, Path(root)
    tmp = root / f"step-{step:06d}.tmp"
    parts_agree(dist, root, step, part(lambda: staging_dir(root, step)) if dist.is_main else None)
    gathered = learner.policy_tensors() if learner.zero_stage >= 3 else None  # ZeRO-3: collective gather

    def own_files() -> None:
        if dist.is_main:
            learner.module.save_pretrained(tmp, safe_serialization=True,
                                           **({"state_dict": gathered} if gathered is not None else {}))
            learner.processor.save_pretrained(tmp)
            if model_card:
                (tmp / "README.md").write_text(model_card)
            write_trainer_state(tmp, {**meta, "step": step})
        save_rank_rng(tmp, dist.rank)

    parts_agree(dist, root, step, part(own_files))
    engine = learner.engine.checkpoint_engine
    engine.writing()  # this rank's failures are kept: every rank reaches save_checkpoint's collectives
    try:
        learner.engine.save_checkpoint(str(tmp / "deepspeed"), tag=LATEST, save_latest=False,
                                       exclude_frozen_parameters=True)
    finally:
        failed = engine.written()
    if failed is None and dist.is_main:
        failed = part(lambda: (tmp / "deepspeed" / "latest").write_text(LATEST))
    parts_agree(dist, root, step, failed)
    total_limit = learner.cfg.learner.save_total_limit
    parts_agree(dist, root, step, part(lambda: commit_checkpoint(root, step, total_limit)) if dist.is_main else None)
    return root / f"step-{step:06d}"


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
    if snap.weights is not None:  # rank 0: DeepSpeed's ``latest``, as a synchronous checkpoint has it
        (tmp / "deepspeed" / "latest").write_text(LATEST)
        fsync_written_tree(tmp)  # what it wrote (save_pretrained's names), and the folders
    else:
        for path in written:
            fsync_path(path)
    return tmp  # the folders again, with every rank's files in them: finalise()


def fsync_written_tree(folder: Path) -> None:
    """Rank 0's :func:`~streamgrpo.learner.checkpoint.files.fsync_tree` while other ranks still write into ``folder``:
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
