"""The long-video frontier: the most frames per video a memory plan fits, and the part that limits it (pure).

A plan's parts (:mod:`streamgrpo.learner.memory.plan`, :mod:`streamgrpo.learner.memory.step`) never shrink
as a video gets longer, so the largest frame count whose parts fit a capacity is a bisection over frame
counts. The part that *limits* is the one that grew most between the smallest video and the frontier
(the static parts, which do not grow, are the floor every row starts from). ``benchmarks/bench_frontier.py``
prints the table of docs/performance.md with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

Parts = Mapping[str, float]


@dataclass(frozen=True)
class Frontier:
    frames: int
    """The most frames per video that fit (0: not even ``step`` frames)."""
    limit: str
    """The part that grew most up to there (``static`` when nothing fits: the parts that do not grow)."""
    parts: dict[str, float]
    """The parts at ``frames`` (at ``step`` frames when nothing fits)."""
    capped: bool = False
    """``frames`` is the search's upper bound: more may fit."""


def max_frames(parts_at: Callable[[int], Parts], capacity: float, *, most: int = 4096, step: int = 2,
               static: Parts | None = None) -> Frontier:
    """The largest multiple of ``step`` frames, at most ``most``, whose ``parts_at(frames)`` (plus ``static``)
    sum to at most ``capacity`` bytes, and the part that limits it (the module docstring has the rule)."""
    base = dict(static or {})

    def total(frames: int) -> tuple[float, dict[str, float]]:
        parts = {**base}
        for name, b in parts_at(frames).items():
            parts[name] = parts.get(name, 0.0) + b
        return sum(parts.values()), parts

    first_total, first = total(step)
    if first_total > capacity:
        return Frontier(0, "static", first)
    lo, hi = 1, most // step  # lo fits; find the largest k <= hi with k * step fitting
    top_total, top = total(hi * step)
    if top_total <= capacity:
        return Frontier(hi * step, _grew_most(first, top), top, capped=True)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total(mid * step)[0] <= capacity:
            lo = mid
        else:
            hi = mid
    _, at = total(lo * step)
    _, over = total(hi * step)
    return Frontier(lo * step, _grew_most(first, over), at)


def _grew_most(first: Parts, last: Parts) -> str:
    growth = {name: last[name] - first.get(name, 0.0) for name in last}
    return max(growth, key=lambda name: growth[name])
