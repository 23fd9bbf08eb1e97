"""Answer extraction and text helpers shared by every reward (the one place that reads tags).

* :func:`extract_answer` -- the content of the last complete ``<answer>...</answer>`` block.
* :func:`answer_text` -- that, or (only when a reward's ``fallback`` param says so) the completion
  with its reasoning blocks removed.
* :func:`normalize` -- the normal form used for string comparisons.
* :func:`numbers` / :func:`first_number` -- numbers as written by people and models
  (``65.4%``, ``1,200``, ``-3.5``).

Tags are matched case-sensitively, exactly as written (``<answer>``, not ``<Answer>``), the same
way the format rewards see them. Every helper is linear in the text length (no regex
backtracking over tags), so adversarial completions cannot stall a generator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last complete ``<tag>...</tag>`` block of ``text``.

    Returns ``None`` when there is no complete block (no tag, or an unclosed one as in a truncated
    generation) and ``""`` for an empty block. Several blocks: the last one counts.
    """
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_t)
    if end < 0:
        return None
    start = text.rfind(open_t, 0, end)
    if start < 0:
        return None
    return text[start + len(open_t) : end].strip()


def strip_blocks(text: str, tag: str) -> str:
    """``text`` without its ``<tag>...</tag>`` blocks (an unclosed ``<tag>`` drops the rest)."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(open_t, pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(close_t, start + len(open_t))
        if end < 0:
            break
        pos = end + len(close_t)
    return "".join(out)


def answer_text(
    completion: str, *, answer_tag: str = "answer", think_tag: str | None = "think", fallback: bool = False
) -> str | None:
    """What a reward compares: the ``<answer>`` content, or with ``fallback`` the whole completion.

    The fallback (used only where a reward's params say so) removes ``<think_tag>`` blocks first,
    so numbers or options inside the reasoning are not mistaken for the answer. ``None`` means
    "no answer" (the reward scores 0).
    """
    if not isinstance(completion, str):
        completion = "" if completion is None else str(completion)
    found = extract_answer(completion, answer_tag)
    if found is not None or not fallback:
        return found
    text = strip_blocks(completion, think_tag) if think_tag else completion
    return text.replace(f"<{answer_tag}>", " ").replace(f"</{answer_tag}>", " ").strip()


def truth_text(answer: Any, answer_tag: str = "answer") -> str:
    """The ground truth as a string: the ``<answer>`` content if tagged (a gpt turn), else the whole."""
    text = "" if answer is None else str(answer)
    found = extract_answer(text, answer_tag)
    return text.strip() if found is None else found


_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalize(text: str) -> str:
    """Case-folded words separated by single spaces (punctuation and underscores dropped)."""
    return _NON_WORD.sub(" ", text.casefold()).strip()


# A number: thousands separators (1,200), decimals (-3.5, .5); a trailing % is ignored.
_NUMBER = re.compile(
    r"(?<![\w.])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])[-+\u2212]?\.\d+"
)


def numbers(text: str) -> list[float]:
    """Every finite number in ``text``, in order (``"1,200 and -3.5%"`` -> ``[1200.0, -3.5]``)."""
    out = []
    for m in _NUMBER.finditer(text):
        raw = m.group(0).replace(",", "").replace("\u2212", "-")
        try:
            value = float(raw)
        except ValueError:  # pragma: no cover - the regex only admits float syntax
            continue
        if math.isfinite(value):
            out.append(value)
    return out


def first_number(text: str) -> float | None:
    """The first finite number in ``text`` or ``None``."""
    found = numbers(text)
    return found[0] if found else None


_NUMBER_ONLY = re.compile(
    r"^\s*[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*%?\s*\.?\s*$|^\s*[-+]?\.\d+\s*%?\s*$"
)


def is_number_only(text: str) -> bool:
    """True when ``text`` is one number (optionally with ``%``), e.g. a numeric ground truth ``37.5``."""
    return bool(_NUMBER_ONLY.match(text))


# ------------------------------------------------------------------------------- batching
def field_at(fields: Mapping[str, Any], key: str, i: int, n: int) -> Any:
    """Field ``key`` for completion ``i`` of ``n``: a list/tuple of length n is per completion, else shared."""
    value = fields.get(key)
    if isinstance(value, (list, tuple)) and len(value) == n:
        return value[i]
    return value


def per_completion(score_one: Callable[[str, str, Mapping[str, Any], int, int], float], name: str):
    """Lift ``score_one(completion, answer, fields, i, n) -> float`` to a batched reward function.

    ``answers`` may have one entry (shared by every completion) or one per completion.
    """

    def reward(completions: Sequence[str], answers: Sequence[Any] | str, **fields: Any) -> list[float]:
        if isinstance(answers, str):
            answers = [answers]
        n = len(completions)
        if len(answers) == 1 and n != 1:
            answers = list(answers) * n
        if len(answers) != n:
            raise ValueError(f"reward {name!r}: {len(answers)} answers for {n} completions")
        return [float(score_one(c, a, fields, i, n)) for i, (c, a) in enumerate(zip(completions, answers))]

    reward.__name__ = f"{name}_reward"
    reward.__qualname__ = reward.__name__
    return reward
