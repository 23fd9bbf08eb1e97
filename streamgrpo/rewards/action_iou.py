"""``action_iou``: answers that list actions, ``(1) Pick up (2) Rotate``; IoU of the two sets.

Items are split at ``(n)`` markers or ``n.``/``n)`` at a line start; without markers, at
newlines, ``;``, ``,`` and `` then ``. Items compare as normalised text (order ignored); an item
that is only a marker (``(1) (2)``) stands for its number. Equal sets -> 1.0, disjoint -> 0.0,
else ``|A & B| / |A | B|``. An empty or missing answer scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .extract import answer_text, normalize, per_completion, truth_text
from .registry import register

_MARKER = re.compile(r"\(\s*(\d{1,3})\s*\)|(?m:^)[ \t]*(\d{1,3})[.)](?=\s)")
_SEPARATORS = re.compile(r"\n|;|,|\bthen\b", re.IGNORECASE)


def parse_actions(text: str) -> set[str]:
    """The set of normalised action items listed in ``text``."""
    marks = list(_MARKER.finditer(text))
    items: set[str] = set()
    if marks:
        for k, m in enumerate(marks):
            end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
            item = normalize(text[m.end() : end])
            items.add(item if item else f"({m.group(1) or m.group(2)})")
        return items
    for part in _SEPARATORS.split(text):
        item = normalize(part)
        if item:
            items.add(item)
    return items


def iou(a: set[str], b: set[str]) -> float:
    """Intersection over union of two sets (0.0 when both are empty)."""
    union = a | b
    return len(a & b) / len(union) if union else 0.0


@register("action_iou")
def action_iou(answer_tag: str = "answer", think_tag: str | None = "think", fallback: bool = False):
    """IoU of the predicted and ground-truth action sets."""

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        pred = answer_text(completion, answer_tag=answer_tag, think_tag=think_tag, fallback=fallback)
        if not pred:
            return 0.0
        truth = parse_actions(truth_text(answer, answer_tag))
        if not truth:
            return 0.0
        return iou(parse_actions(pred), truth)

    return per_completion(one, "action_iou")
