"""A step that one bad group cannot stop: on a failure, find the group that fails alone.

Behaviour, not bookkeeping: what is dead-lettered (``poison``), what is carried to the next step,
what is counted in Redis toward ``queue.max_failures`` and re-raised, and what is dropped as
``nan_loss``.
"""

from __future__ import annotations

import logging

from streamgrpo import metrics as M
from streamgrpo.learner.distributed import DistInfo, is_peer_failure
from streamgrpo.learner.intake.gate import Gate
from streamgrpo.learner.memory.oom import LearnerOutOfMemory, StepOutOfMemory, shrink_after
from streamgrpo.learner.state import Accepted
from streamgrpo.learner.step_data import Probe, StepOutput
from streamgrpo.learner.trainer import Learner

log = logging.getLogger("streamgrpo.learner")


def guarded_step(learner: Learner, queue, gate: Gate, batch: list[Accepted],
                 dist: DistInfo, reads: bool = True) -> tuple[StepOutput | None, list[Accepted]]:
    """``learner.train_step(batch)`` that one bad group cannot stop: returns ``(out, carry)``.

    ``out`` is None when nothing was applied; ``carry`` are groups to train in the next step. On an
    exception or a non-finite loss a one-rank torch learner probes each group alone (forward +
    backward, nothing applied): the groups that fail alone are dead-lettered (``poison``) and the
    rest carried over. A collective's failure on a rank of several (another rank died, the link between ranks
    broke: :func:`~streamgrpo.learner.distributed.is_peer_failure`) is re-raised and never counted against the
    groups. When no single group explains the failure (or with several ranks, where one
    rank cannot probe alone), an exception is counted per group in Redis and re-raised (a restarted
    learner dead-letters a group at ``queue.max_failures``), and a non-finite loss drops the step's
    groups as ``nan_loss``. ``reads`` false: a sequence-parallel rank whose groups its reader owns (and drops): an
    exception of its own is counted per group too (its reader's step then fails as a peer's, counting nothing, and
    its next start dead-letters the group at ``queue.max_failures``) and re-raised; else it returns ``(None, [])``.
    """
    try:
        out = _train_within_memory(learner, batch)
        error = None if out is not None else "non-finite loss or gradient"
    except LearnerOutOfMemory:
        raise  # a setting must change: not the groups' fault
    except Exception as exc:  # noqa: BLE001 - isolated below, re-raised when no group explains it
        out, error, raised = None, f"{type(exc).__name__}: {exc}", exc
    else:
        raised = None
    if out is not None:
        return out, []
    M.ERRORS.labels(kind="train").inc()
    where = ", ".join(f"{a.group.group_id} (entry {a.stream_id})" for a in batch)
    if raised is not None and dist.world_size > 1 and is_peer_failure(raised):
        M.ERRORS.labels(kind="peer").inc()
        log.error("training step failed because another rank or the link between ranks failed (%s): not counted "
                  "against this rank's groups %s; they are trained again after the restart", error, where)
        raise raised
    if not reads:
        if raised is not None:
            log.error("training step failed on this sequence-parallel rank (%s) on its reader's groups %s", error, where)
            queue.record_failure([a.group.group_id for a in batch], error)
            raise raised
        return None, []
    log.error("training step failed (%s) on groups %s", error, where)
    bad = _fail_alone(learner, batch) if dist.world_size == 1 and not learner.deepspeed else []
    if bad and len(bad) < len(batch):
        for a, why in bad:
            gate.dead_letter(a.stream_id, a.group, f"group {a.group.group_id}: training on it alone failed: {why}",
                             "poison")
        poisoned = {id(a) for a, _ in bad}
        return None, [a for a in batch if id(a) not in poisoned]
    if raised is not None:
        queue.record_failure([a.group.group_id for a in batch], error)
        raise raised
    for a in batch:
        gate.drop(a.stream_id, a.group.group_id, "nan_loss", source=a.group.source)
    return None, []


def _train_within_memory(learner: Learner, batch: list[Accepted]) -> StepOutput | None:
    """``learner.train_step(batch)``, retried with half the micro-batch budget while it runs out of
    memory (:mod:`streamgrpo.learner.memory.oom`); the groups stay this step's, uncommitted, meanwhile."""
    while True:
        try:
            return learner.train_step(batch)
        except StepOutOfMemory as oom:
            shrink_after(learner, oom)


def _fail_alone(learner: Learner, batch: list[Accepted]) -> list[tuple[Accepted, str]]:
    """The groups of ``batch`` whose step alone (forward + backward, nothing applied) raises or is not finite,
    with why."""
    bad: list[tuple[Accepted, str]] = []
    learner.discard_gradients()
    for a in batch:
        try:
            probe: Probe = learner.train_step([a], dry_run=True)
            why = None if probe.finite else "non-finite loss or gradient"
        except Exception as exc:  # noqa: BLE001 - this group alone raises: it is the poison
            why = f"{type(exc).__name__}: {exc}"
        if why:
            bad.append((a, why))
    learner.discard_gradients()
    return bad
