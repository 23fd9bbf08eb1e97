"""``exact_match``: 1.0 when the answer equals the ground truth after normalisation, else 0.0.

Normalisation (:func:`streamgrpo.rewards.extract.normalize`): case-folded, punctuation and
repeated whitespace dropped (``case_sensitive=True`` keeps the case). Empty or missing answers
score 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .extract import _NON_WORD, answer_text, normalize, per_completion, truth_text
from .registry import register


@register("exact_match")
def exact_match(
    answer_tag: str = "answer",
    think_tag: str | None = "think",
    fallback: bool = False,
    case_sensitive: bool = False,
):
    """Normalised string equality between the extracted answer and the ground truth."""

    def norm(text: str) -> str:
        return _NON_WORD.sub(" ", text).strip() if case_sensitive else normalize(text)

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        pred = answer_text(completion, answer_tag=answer_tag, think_tag=think_tag, fallback=fallback)
        if not pred:
            return 0.0
        want = norm(truth_text(answer, answer_tag))
        return 1.0 if want and norm(pred) == want else 0.0

    return per_completion(one, "exact_match")
