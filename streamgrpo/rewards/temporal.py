"""T-GRPO's temporal contrast (Video-R1): reward correct answers only when frame order helped.

Per video prompt the generator also samples ``G'`` completions on the same frames in a shuffled
order. With ``p`` the fraction of correct completions on ordered frames and ``p_shuffled`` on
shuffled ones, every correct ordered completion gets a bonus ``alpha`` when ``p > mu * p_shuffled``,
else nothing. The shuffled completions are scored here and never trained on. Correct means the
``reward`` function's value is at least ``correct_at``. Pure: lists of reward values in, a
:class:`TemporalBonus` out; :func:`with_bonus` adds it to a group's :class:`ScoredRewards` as its
own reward function, ``fn="temporal"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .combine import ScoredRewards

TEMPORAL = "temporal"


@dataclass(frozen=True)
class TemporalBonus:
    p: float  # fraction correct on ordered frames
    p_shuffled: float  # fraction correct on shuffled frames
    applied: bool  # p > mu * p_shuffled
    bonus_G: list[float]  # per ordered completion


def temporal_bonus(ordered_G: Sequence[float], shuffled_S: Sequence[float], *, alpha: float, mu: float,
                   correct_at: float) -> TemporalBonus:
    """The bonus of each ordered completion from the correctness rewards of both groups."""
    if not ordered_G or not shuffled_S:
        raise ValueError(f"temporal contrast needs both groups, got {len(ordered_G)} ordered and {len(shuffled_S)} "
                         "shuffled completions")
    correct_G = [v >= correct_at for v in ordered_G]
    p = sum(correct_G) / len(correct_G)
    p_shuffled = sum(v >= correct_at for v in shuffled_S) / len(shuffled_S)
    applied = p > mu * p_shuffled
    return TemporalBonus(p, p_shuffled, applied, [alpha if applied and c else 0.0 for c in correct_G])


def with_bonus(scored: ScoredRewards, bonus: TemporalBonus) -> ScoredRewards:
    """``scored`` with the bonus as reward function ``temporal`` (weight 1: ``alpha`` is its size)."""
    totals = [t + b for t, b in zip(scored.totals, bonus.bonus_G)]
    return ScoredRewards(totals=totals, per_fn={**scored.per_fn, TEMPORAL: list(bonus.bonus_G)}, errors=scored.errors)
