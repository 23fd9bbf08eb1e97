"""What the learner refuses as soon as a group is read, before any of its visuals is decoded.

:class:`Screen` wraps the queue a learner rank reads (under :class:`~streamgrpo.learner.intake.media.ReadAhead`,
which starts decoding what it is given): a group over ``learner.max_group_pixels`` /
``max_group_tokens`` (:mod:`.limits`) is dead-lettered ``too_large``, one that crash-looped
(:mod:`.crash_loop`) ``crash_loop``; each one line, counted in ``groups_dropped{reason}``, written to the
audit log, its message kept in the dead letters.
"""

from __future__ import annotations

import logging

from streamgrpo import metrics as M
from streamgrpo.learner.intake.crash_loop import CrashLoopBreaker
from streamgrpo.learner.intake.limits import GroupLimits, too_large

log = logging.getLogger("streamgrpo.learner")


class Screen:
    """``queue.get`` without the groups that are too large or crash-looped (dead-lettered here)."""

    def __init__(self, queue, gate, limits: GroupLimits, breaker: CrashLoopBreaker | None = None):
        self.queue, self.gate, self.limits, self.breaker = queue, gate, limits, breaker

    def get(self, n: int, timeout_s: float) -> list:
        return [d for d in self.queue.get(n, timeout_s) if self._passes(d)]

    def _passes(self, d) -> bool:
        g = d.group
        why, label = too_large(g, self.limits), "too_large"
        if why is None and self.breaker is not None:
            why, label = self.breaker.verdict(g.group_id), "crash_loop"
        if why is None:
            return True
        M.GROUPS.labels(event="consumed").inc()
        self.gate.audit.write({"event": "consumed", "group_id": g.group_id, "generator": g.generator_id})
        self.gate.dead_letter(d.stream_id, g, f"{label}: {why}", label)
        if self.breaker is not None:
            self.breaker.forget(g.group_id)
        return False

    def __getattr__(self, name: str):  # everything else is the queue's
        return getattr(self.queue, name)
