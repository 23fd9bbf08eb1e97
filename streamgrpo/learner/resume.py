"""Where a learner starts: refuse, resume or set aside what a run directory holds; resume from a
checkpoint (logs trimmed back, its commit rolled forward); the final checkpoint of a clean stop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from streamgrpo.config import ConfigError, LearnerConfig
from streamgrpo.learner.distributed import DistInfo, barrier, broadcast_json, gather_json, share
from streamgrpo.learner.gate import Gate
from streamgrpo.learner.state import LearnerState
from streamgrpo.learner.trainer import Learner
from streamgrpo.runtime import LEARNER_OUTPUTS, archive_previous, rewind_jsonl

log = logging.getLogger("streamgrpo.learner")


def start_point(lc: LearnerConfig, run_dir: Path, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from (None: start at step 0), agreed by every rank.

    A run directory with checkpoints is resumed with ``learner.resume`` (``--resume``) or set aside
    with ``learner.fresh`` (``--fresh``: checkpoints, metrics.jsonl and the learner's audit logs move
    to ``<run_dir>/previous/<time>/``); with neither, the learner refuses (ConfigError) rather than
    start at v0 next to them.
    """
    from streamgrpo.learner.checkpoint import latest_checkpoint

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


def resume_from(found: Path, learner: Learner, queue, audit_path: Path, run_dir: Path, dist: DistInfo) -> None:
    """Load the checkpoint ``found``, trim the logs back to its step (their training is re-done) and
    roll its commit forward on rank 0 (it may not have happened); every rank waits for that before it
    reads its pending entries.

    A checkpoint that does not load, holds non-finite weights, or is older than the newest step whose
    groups Redis already committed (resuming there would lose what that one trained) is refused with
    a one-line :class:`~streamgrpo.learner.checkpoint.CheckpointUnusable`."""
    from streamgrpo.learner.checkpoint import CheckpointUnusable

    why = None
    try:
        learner.load(found)
    except Exception as exc:  # noqa: BLE001 - any failure to read it back: say which and what to do
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    bad = None if why else learner.nonfinite_weight()
    flags = share(dist, [why is not None, bad is not None])  # every rank refuses together, none waits
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
        if learner.state.committing:  # roll the checkpoint's commit forward (it may not have happened)
            queue.commit(learner.state.committing, step=learner.state.step)
    if rewound:
        log.info("dropped %d log line(s) written after step %d (their training is re-done)", rewound,
                 learner.state.step)
    barrier(dist)  # no rank reads its pending entries before the roll-forward


def final_checkpoint(dist: DistInfo, gate: Gate, state: LearnerState, saved_step: int,
                     checkpoint_and_commit: Callable[[], None]) -> None:
    """On a clean stop (every rank here): merge the drops since the last step, then checkpoint and
    commit what was trained since the last checkpoint."""
    from streamgrpo.transport.queue.redis_stream import QueueError

    for late in gather_json(dist, dict(gate.drops)):  # drops since the last step, of every rank
        state.dropped.update(late)
    if state.step > saved_step:
        try:
            checkpoint_and_commit()
        except QueueError as exc:  # checkpoint written; the next start commits what it recorded
            log.warning("checkpoint written, commit deferred to the next start: %s", exc)
