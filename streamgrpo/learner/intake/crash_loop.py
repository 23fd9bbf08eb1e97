"""The crash-loop breaker: one message can never stop training.

A group that kills the learner (a kill -9 by an out-of-memory killer, a decoder's segfault) stays pending, so a
restarted learner reads it again and dies again: the run stands still. So each rank marks the group ids of the step
it is about to train (and ``[]`` once the step returns), with a witness of its state; the groups whose visuals are
decoded outside a step (read-ahead, in the media threads) are marked meanwhile too (the Redis keys:
:mod:`streamgrpo.transport.queue.crash_marks`). A learner that starts and finds that its predecessor died inside a
step or decode judges the death (:func:`streamgrpo.learner.intake.death_cause.judge`): its own (it crashed, it ran out of
memory, or the cause is unknown) adds one to each of those groups' counts; a kill from outside (no out-of-memory
kill, no crash) counts nothing. Then

* a group whose count reached ``learner.crash_loop_starts`` is dead-lettered ``crash_loop`` when next
  read (one line; ``groups_dropped{reason=crash_loop}``);
* a group with a count trains in a step of its own, the most counted first (:meth:`CrashLoopBreaker.isolate`),
  so the next death is counted only for the group that causes it, never for the others of its first step
  (the cost: after a death, up to a step's groups train one per step);
* a step that returns clears its groups' counts: the starts counted are consecutive;
* with several ranks, a step that raises a collective's failure (another rank died, the link between the ranks
  broke: :func:`~streamgrpo.learner.distributed.is_peer_failure`) marks this rank's end as a peer's: the death that
  follows (the rank stops, torchrun restarts them all) is never counted for this rank's groups. Only the rank
  whose own process died in the step (crashed, out of memory) counts it;
* a sequence-parallel group's other ranks (its helpers) mark the groups of its reader's step too, and the reader's
  start judges their marks with its own (:meth:`CrashLoopBreaker.on_start` given their consumers; a helper only
  arms its crash record, :meth:`CrashLoopBreaker.arm`): a group that kills a helper alone is counted, not taken for
  the reader's peer failure and trained again forever.

Best effort: when Redis refuses these small writes the learner says so once and trains on.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from streamgrpo.learner.distributed import is_peer_failure
from streamgrpo.learner.intake.death_cause import Witness, Witnessing
from streamgrpo.transport.queue.base import QueueError

log = logging.getLogger("streamgrpo.learner")


class CrashLoopBreaker:
    """Counts, per group, the learner starts that found it in the step the last one died in (of its own)."""

    def __init__(self, marks, starts: int, ranks: int = 1, crash_dir: Path | None = None):
        self.marks = marks  # a transport.queue.crash_marks.CrashMarks (this rank's)
        self.starts = int(starts)
        self.ranks = int(ranks)
        self.crash_dir = crash_dir  # <run>/crash: each rank's crash record (None: no records)
        self.witnessing = Witnessing(self._crash_path(marks.consumer))
        self.counts: dict[str, int] = {}  # group id -> starts that found it in a dead step (this rank's)
        self._warned = False

    def _crash_path(self, consumer: str) -> Path | None:
        return self.crash_dir / f"{consumer}.txt" if self.crash_dir is not None else None

    def on_start(self, adopted: list[str] = ()) -> list[str]:
        """Judge the deaths of the last learner (and of the ``adopted`` consumers: ranks this start does not have,
        whose groups this rank took over, and a reader's sequence-parallel helpers) in a step or decode; count this
        start for the groups of those that were their own. Returns the ids counted. Then arms this process's crash
        record."""
        consumers = list(dict.fromkeys([self.marks.consumer, *adopted]))  # a helper's may be adopted too
        causes: dict[str, str] = {}  # group id -> why its learner's death was its own
        try:
            for mark in self.marks.read(consumers):
                held = mark.groups + [g for g in mark.reading if g not in mark.groups]
                if not held or mark.peer:
                    continue
                cause = self.witnessing.judge(Witness.from_json(mark.witness), self._crash_path(mark.consumer))
                if not cause.own:
                    log.warning("the last learner (%s) died while training or decoding group(s) %s, %s: not "
                                "counted against them", mark.consumer, ", ".join(held), cause.why)
                for g in held if cause.own else ():
                    causes.setdefault(g, cause.why)
            self.counts = self.marks.count(list(causes), consumers)
        except (QueueError, ValueError, TypeError) as exc:
            self._warn(exc)
            causes = {}
        self.witnessing.arm()
        died_in = list(causes)
        again = [g for g in died_in if self.counts.get(g, 0) < self.starts]  # the others: their dead letter says it
        if again:
            log.warning("the last learner died while training or decoding group(s) %s (%s; %s of %d starts before "
                        "one is dead-lettered as crash_loop): each trains in a step of its own now", ", ".join(again),
                        "; ".join(dict.fromkeys(causes[g] for g in again)),
                        "/".join(str(self.counts.get(g, 0)) for g in again), self.starts)
        return died_in

    def arm(self) -> None:
        """A sequence-parallel helper's start: its crash record armed; its reader judges its marks (``on_start``)."""
        self.witnessing.arm()

    def verdict(self, group_id: str) -> str | None:
        """The dead-letter reason for a group that crash-looped, or None."""
        n = self.counts.get(group_id, 0)
        if n < self.starts:
            return None
        return (f"the learner died while training it in {n} consecutive starts (learner.crash_loop_starts "
                f"{self.starts}): dead-lettered so that training goes on")

    def isolate(self, batch: list) -> tuple[list, list]:
        """``(step, later)``: the group with the highest count alone (the likeliest cause first, before the
        others of its step move the policy on), the rest later; without counts the whole batch."""
        counts = [self.counts.get(a.group.group_id, 0) for a in batch]
        if len(batch) < 2 or not any(counts):
            return batch, []
        i = counts.index(max(counts))
        return [batch[i]], batch[:i] + batch[i + 1:]

    @contextlib.contextmanager
    def stepping(self, group_ids: list[str]):
        """Around the step that trains the groups ``group_ids``: marked before, cleared when it returns (not when it
        raises, unless a peer's failure raised: :meth:`peer_failed`)."""
        self.begin_step(group_ids)
        try:
            yield
        except Exception as exc:
            if self.ranks > 1 and is_peer_failure(exc):
                self.peer_failed()
            raise
        self.end_step(group_ids)

    @contextlib.contextmanager
    def reading(self, group_id: str):
        """Around the work of reading one group outside a step (its visuals decoded in read-ahead, any
        thread): a learner that dies in it counts that start for the group, as for a step."""
        self._mark(lambda: self.marks.reading(group_id, True))
        try:
            yield
        finally:  # returned or raised: the learner is alive
            self._mark(lambda: self.marks.reading(group_id, False))

    def peer_failed(self) -> None:
        """This rank's step failed because another rank did: this rank's end is not its groups' doing."""
        self._mark(lambda: self.marks.mark([], self.witnessing.now().to_json(), peer=True))

    def begin_step(self, group_ids: list[str]) -> None:
        """Before training ``group_ids``: what a learner that starts after a death here will judge and count."""
        ids = list(group_ids)
        self._mark(lambda: self.marks.mark(ids, self.witnessing.now().to_json()))

    def end_step(self, group_ids: list[str]) -> None:
        """The step of ``group_ids`` returned (applied or not): the learner did not die in it."""
        done = [gid for gid in group_ids if gid in self.counts]
        if self._mark(lambda: self.marks.mark([], self.witnessing.now().to_json(), done=done)):
            for gid in done:
                self.counts.pop(gid, None)

    def forget(self, group_id: str) -> None:
        """A dead-lettered group: its count is no longer needed."""
        if self.counts.pop(group_id, None) is not None:
            self._mark(lambda: self.marks.forget(group_id))

    def _mark(self, write) -> bool:
        try:
            write()
            return True
        except QueueError as exc:
            self._warn(exc)
            return False

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("crash-loop breaker off for now: Redis refused its bookkeeping (%s); training goes on",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
