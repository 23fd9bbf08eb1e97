"""``numeric``: closeness of the first number in the answer to the first number in the ground truth.

The rule (as the seed-era numeric reward scored it, which users rely on):

* ground truth without a number -> 0.5 (neutral); prediction without a number -> 0.0;
* otherwise ``min(1, base + (1 - base) * max(0, 1 - (err / scale)**2) * m)`` with
  ``err = |pred - gt|`` and ``m = 1 + emphasis * |gt - center|`` for an exact match only
  (``m = 1`` otherwise). Defaults: ``scale=25``, ``base=0.1``, ``emphasis=1/60``, ``center=50``.

Example rows: GT ``EF is 60%`` vs ``EF is 55%`` -> 0.964; vs ``EF is 60%`` -> 1.0; GT ``60`` vs
``No number`` -> 0.0; GT ``Good quality`` vs ``Excellent`` -> 0.5.

``fallback`` defaults to True here (unlike the other rewards): without an ``<answer>`` block the
completion minus its reasoning blocks is read, as the seed's numeric reward read plain text. An
answer block that is present but empty still scores 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .extract import answer_text, first_number, per_completion, truth_text
from .registry import register


def numeric_score(
    pred: float | None,
    truth: float | None,
    *,
    scale: float = 25.0,
    base: float = 0.1,
    emphasis: float = 1.0 / 60.0,
    center: float = 50.0,
    neutral: float = 0.5,
) -> float:
    """The numeric rule on two already-extracted numbers (``None`` = no number)."""
    if truth is None:
        return neutral
    if pred is None:
        return 0.0
    err = abs(pred - truth)
    ratio = err / scale
    closeness = 0.0 if ratio >= 1.0 else 1.0 - ratio * ratio  # (no ** : it raises on overflow)
    m = 1.0 + emphasis * abs(truth - center) if err == 0 else 1.0
    value = min(1.0, base + (1.0 - base) * closeness * m)
    return max(0.0, value)


@register("numeric")
def numeric(
    scale: float = 25.0,
    base: float = 0.1,
    emphasis: float = 1.0 / 60.0,
    center: float = 50.0,
    neutral: float = 0.5,
    answer_tag: str = "answer",
    think_tag: str | None = "think",
    fallback: bool = True,
):
    """Numeric closeness reward; see the module docstring for the rule and parameters."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not 0.0 <= base <= 1.0:
        raise ValueError(f"base must be in [0, 1], got {base}")
    if not 0.0 <= neutral <= 1.0:
        raise ValueError(f"neutral must be in [0, 1], got {neutral}")
    if emphasis < 0:
        raise ValueError(f"emphasis must be >= 0, got {emphasis}")

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        truth = first_number(truth_text(answer, answer_tag))
        pred_text = answer_text(completion, answer_tag=answer_tag, think_tag=think_tag, fallback=fallback)
        if truth is None:
            return neutral if pred_text else 0.0
        pred = first_number(pred_text) if pred_text else None
        return numeric_score(
            pred, truth, scale=scale, base=base, emphasis=emphasis, center=center, neutral=neutral
        )

    return per_completion(one, "numeric")
