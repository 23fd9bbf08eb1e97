"""Time to target: when the moving mean accuracy of the trained groups in ``metrics.jsonl`` reaches a target
(the demos' and the benchmarks' measure of learning)."""

from __future__ import annotations

import logging

log = logging.getLogger("streamgrpo.runtime")


TARGET_ACCURACY = 0.9


WINDOW_GROUPS = 50
"""Time to target: the moving mean accuracy of the last WINDOW_GROUPS trained groups reaches TARGET_ACCURACY."""


def group_accuracies(rows) -> list[tuple[int, float, float]]:
    """``(step, time, accuracy)`` of every trained group of ``metrics.jsonl`` rows, in training order."""
    return [(int(r["step"]), float(r["time"]), float(a)) for r in rows for a in r.get("group_accuracy") or []]


def target_reached(rows, target: float = TARGET_ACCURACY, window: int = WINDOW_GROUPS) -> tuple[int, float] | None:
    """``(step, time)`` at which the mean accuracy of the last ``window`` trained groups first reaches
    ``target`` (None if it never does)."""
    accs = group_accuracies(rows)
    total = 0.0
    for i, (_, _, a) in enumerate(accs):
        total += a
        if i >= window:
            total -= accs[i - window][2]
        if i >= window - 1 and total / window >= target - 1e-12:
            return accs[i][0], accs[i][1]
    return None
