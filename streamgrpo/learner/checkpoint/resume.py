"""Where a learner starts: refuse, resume or set aside what a run directory holds; resume from a
checkpoint (logs trimmed back, its commit rolled forward); the final checkpoint of a clean stop."""

from __future__ import annotations

import logging
from pathlib import Path

from streamgrpo.config import ConfigError, LearnerConfig
from streamgrpo.data.cursor import advance
from streamgrpo.learner.checkpoint.commit import Checkpointing
from streamgrpo.learner.checkpoint.files import CheckpointUnusable, latest_checkpoint
from streamgrpo.learner.distributed import DistInfo, ReadLayout, barrier, broadcast_json, gather_json, share
from streamgrpo.learner.intake.gate import Gate
from streamgrpo.learner.state import LearnerState
from streamgrpo.learner.trainer import Learner
from streamgrpo.runtime.jsonl import rewind_jsonl
from streamgrpo.runtime.run_dir import LEARNER_OUTPUTS, archive_previous
from streamgrpo.transport.queue.redis_stream import QueueError

log = logging.getLogger("streamgrpo.learner")


def start_point(lc: LearnerConfig, run_dir: Path, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from (None: start at step 0), agreed by every rank.

    A run directory with checkpoints is resumed with ``learner.resume`` (``--resume``) or set aside
    with ``learner.fresh`` (``--fresh``: checkpoints, metrics.jsonl and the learner's audit logs move
    to ``<run_dir>/previous/<time>/``); with neither, the learner refuses (ConfigError) rather than
    start at v0 next to them.
    """

    root = run_dir / "checkpoints"
    if lc.resume and lc.fresh:
        raise ConfigError("learner.resume and learner.fresh are both set: pick one")
    newest = broadcast_json(dist, str(latest_checkpoint(root) or ""))  # rank 0 decides for everyone
    if lc.resume:
        if not newest:
            log.info("resume: no checkpoint under %s, starting fresh", root)
        return Path(newest) if newest else None
    if newest and not lc.fresh:
        raise ConfigError(f"{run_dir} already has checkpoints (newest {Path(newest).name}): pass --resume "
                          "(learner.resume=true) to continue from it, or --fresh (learner.fresh=true) to start "
                          "over (they move to previous/)")
    if newest and dist.is_main:
        dest = archive_previous(run_dir, LEARNER_OUTPUTS)
        log.warning("--fresh: the previous run's checkpoints and logs moved to %s", dest)
    barrier(dist)
    return None


def weights_source(lc: LearnerConfig, found: Path | None, run_dir: Path | None = None) -> Path | None:
    """The checkpoint folder ``learner.from_weights`` names, when this start uses it (at step 0; a resume wins),
    checked before any model is loaded: a ConfigError of one line when it holds no weights. A folder of this
    run directory's checkpoints that ``--fresh`` has just moved to ``previous/<time>/`` is found there."""
    if not lc.from_weights:
        return None
    if found is not None:
        log.info("--from-weights %s not used: resuming this run from %s", lc.from_weights, found)
        return None
    src = Path(lc.from_weights).expanduser()
    if not src.exists() and run_dir is not None:
        src = _moved_aside(src, run_dir) or src
    names = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    if not src.is_dir() or not any((src / n).is_file() for n in names):
        raise ConfigError(f"learner.from_weights={lc.from_weights!r}: not a checkpoint folder with weights (expected "
                          f"{' or '.join(names)} in it, e.g. <run_dir>/checkpoints/step-000100)")
    return src


def _moved_aside(src: Path, run_dir: Path) -> Path | None:
    """Where ``src``, a path inside ``run_dir``, is now if ``--fresh`` moved it to the newest ``previous/<time>/``."""
    try:
        rel = src.resolve().relative_to(run_dir.resolve())
    except ValueError:
        return None
    moved = sorted((run_dir / "previous").glob("*"))
    return moved[-1] / rel if moved and (moved[-1] / rel).exists() else None


def start_from_weights(src: Path, learner: Learner, dist: DistInfo) -> None:
    """Step 0 from the weights in ``src`` (every rank): the optimizer and lr schedule stay as built (fresh)."""
    try:
        learner.load_weights_only(src)
    except Exception as exc:  # noqa: BLE001 - a model that does not match ...: one line
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    else:
        why = None
    if share(dist, [why is not None])[:, 0].any():
        raise ConfigError(f"learner.from_weights={str(src)!r} cannot be loaded ({why or 'on another rank'})")
    log.info("started from the weights of %s (step 0, policy v0, fresh optimizer and lr schedule)", src)


def resume_from(found: Path, learner: Learner, queue, audit_path: Path, run_dir: Path, dist: DistInfo) -> None:
    """Load the checkpoint ``found``, trim the logs back to its step (their training is re-done) and
    roll its commit forward on rank 0 (it may not have happened); every rank waits for that before it
    reads its pending entries.

    A checkpoint that does not load, holds non-finite weights, or is older than the newest step whose
    groups Redis already committed (resuming there would lose what that one trained) is refused with
    a one-line :class:`~streamgrpo.learner.checkpoint.files.CheckpointUnusable`."""

    why = refused = None
    try:
        learner.load(found)
    except CheckpointUnusable as exc:  # it cannot be resumed here (shards missing...): its own line says why
        refused = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure to read it back: say which and what to do
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    bad = None if why or refused else learner.nonfinite_weight()
    flags = share(dist, [why is not None, bad is not None, refused is not None])  # every rank refuses together
    if flags[:, 2].any():
        raise CheckpointUnusable(refused or f"{found} cannot be resumed on these ranks (see rank 0's log)")
    if flags[:, 0].any():
        raise CheckpointUnusable(
            f"{found} cannot be loaded ({why or 'on another rank'}): move it aside (mv {found} {found}.broken) and "
            "--resume from the one before it; the learner refuses that one too if Redis already committed this "
            "one's groups")
    if flags[:, 1].any():
        raise CheckpointUnusable(f"{found} holds non-finite weights ({bad or 'on another rank'}): it cannot be "
                                 "trained on or published; resume from an earlier checkpoint or start over with --fresh")
    committed = queue.committed_step() if dist.is_main else None
    committed = broadcast_json(dist, committed)
    if committed is not None and committed > learner.state.step:
        raise CheckpointUnusable(
            f"{found} is step {learner.state.step}, but Redis already committed the groups of step {committed} "
            f"(trained, and deleted from the queue): resuming here would lose those of steps "
            f"{learner.state.step + 1}..{committed}; restore checkpoints/step-{committed:06d} and --resume, or "
            "start over with --fresh")
    log.info("resumed from %s at step %d (policy v%d)", found, learner.state.step, learner.state.version)
    rewound = rewind_jsonl(audit_path, learner.state.step)
    if dist.is_main:
        rewound += rewind_jsonl(run_dir / "metrics.jsonl", learner.state.step)
        for gone in _audits_of_absent_ranks(audit_path.parent, dist.world_size):  # resumed on fewer ranks
            rewound += rewind_jsonl(gone, learner.state.step)
        if learner.state.committing or learner.state.data_cursor:  # roll the checkpoint's commit forward (it may
            # not have happened), and its data cursor with it (Redis may have lost it; a later one is kept)
            queue.commit(learner.state.committing, step=learner.state.step, cursor=learner.state.data_cursor)
    if rewound:
        log.info("dropped %d log line(s) written after step %d (their training is re-done)", rewound,
                 learner.state.step)
    barrier(dist)  # no rank reads its pending entries before the roll-forward


def _audits_of_absent_ranks(audit_dir: Path, world_size: int) -> list[Path]:
    """The audit logs of ranks ``world_size`` and above (a run resumed on fewer ranks than wrote them): their
    lines after the checkpoint are trained again by the ranks there are now, so they are trimmed too."""
    found = []
    for path in audit_dir.glob("learner-rank*.jsonl"):
        rank = path.stem.removeprefix("learner-rank")
        if rank.isdigit() and int(rank) >= world_size:
            found.append(path)
    return sorted(found)


def absent_rank_consumers(consumers, rank: int, world_size: int, sequence_parallel: int = 1) -> list[str]:
    """Of the queue's consumers (names), the learner ranks that do not read in this start (``learner-<k>``: ``k >=
    world_size``, a run on more ranks or killed with some; or a rank that is not the reader of its
    sequence-parallel group now, :class:`~streamgrpo.learner.distributed.ReadLayout`): their pending groups are no
    one's now, so a reader takes them at once instead of after ``queue.claim_idle_s``: a helper's its own reader
    (which also judges its crash-loop marks), an absent rank's the reader of replica ``k % replicas``."""
    layout = ReadLayout(rank, world_size, sequence_parallel)
    if not layout.reads:
        return []
    out = []
    for name in consumers:
        k = name.removeprefix("learner-")
        if not (name.startswith("learner-") and k.isdigit()):
            continue
        k = int(k)
        if k >= world_size:
            owner = k % layout.replicas
        elif k % sequence_parallel:  # a helper of this start
            owner = k // sequence_parallel
        else:
            continue
        if owner == rank // sequence_parallel:
            out.append(name)
    return sorted(out, key=lambda n: int(n.removeprefix("learner-")))


def adopt_absent_ranks(queue, layout: ReadLayout) -> list[str]:
    """Claim now every pending group of the learner ranks that do not read in this start (their death is known:
    this learner started without them, or they hand their groups' reading to their reader now); returns the
    consumers adopted."""
    adopted = []
    for name in absent_rank_consumers(queue.pending_consumers(), layout.rank, layout.world_size,
                                      layout.sequence_parallel):
        n = queue.adopt(name)
        if n:
            adopted.append(name)
            log.warning("claimed %d uncommitted group(s) of %s, a learner rank this start does not have: trained "
                        "again now, not after queue.claim_idle_s", n, name)
    return adopted


def final_checkpoint(dist: DistInfo, gate: Gate, state: LearnerState, saved_step: int, ckpts: Checkpointing) -> None:
    """On a clean stop (every rank here): merge the drops since the last step, wait for a background write and
    commit it, then checkpoint and commit what was trained since the last checkpoint."""

    for late in gather_json(dist, {"drops": dict(gate.drops), "at": gate.dropped_at}):  # since the last step, all ranks
        state.dropped.update(late["drops"])
        state.data_cursor = advance(state.data_cursor, late["at"])
    try:
        ckpts.finish()
        if state.step > saved_step:
            ckpts.save(wait=True)
    except QueueError as exc:  # checkpoint written; the next start commits what it recorded
        log.warning("checkpoint written, commit deferred to the next start: %s", exc)
