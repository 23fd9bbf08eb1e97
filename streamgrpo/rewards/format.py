"""Format rewards: ``format`` (the seed's think/answer rule) and the TRL-cookbook family.

* ``format``: complete ``<think>...</think>`` block +0.3, complete ``<answer>...</answer>`` block
  +0.3, the (first) think block closed before the (last) answer block opens +0.4. With
  ``think_tag=None`` (the ``no_think`` prompt format) it is 1.0 for an answer block, else 0.
* ``strict_format`` (cookbook): the whole completion is ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n
  ...\\n</answer>`` (one trailing newline allowed) -> ``score`` (0.5), else 0.
* ``soft_format`` (cookbook): a reasoning block then (whitespace) an answer block at the start ->
  ``score`` (0.5), else 0.
* ``xml_count`` (cookbook ``count_xml``): 0.125 per tag line present exactly once, minus 0.001 per
  character after the closing answer tag; clipped to [0, 1] (the cookbook can go below 0).

The cookbook rewards default to the cookbook's ``<reasoning>`` tag; ``format`` to ``<think>``. Every
tag name is a parameter (``think_tag``, ``answer_tag``). Differences from the cookbook, on purpose:
``.`` matches newlines (multi-line reasoning is normal) and leading whitespace is allowed. The
two layout checks are written as linear scans (equivalent to the cookbook regexes, see the
tests): the regexes backtrack quadratically on completions that repeat the tags.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .extract import per_completion
from .registry import register


def _first_block(text: str, tag: str) -> tuple[int, int] | None:
    """(start, end) of the first complete ``<tag>...</tag>`` block."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    close = text.find(f"</{tag}>", start + len(tag) + 2)
    return None if close < 0 else (start, close + len(tag) + 3)


def _last_block(text: str, tag: str) -> tuple[int, int] | None:
    """(start, end) of the last complete ``<tag>...</tag>`` block."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    return None if start < 0 else (start, close + len(tag) + 3)


def format_score(
    text: str,
    think_tag: str | None = "think",
    answer_tag: str = "answer",
    weights: tuple[float, float, float] = (0.3, 0.3, 0.4),
) -> float:
    """The ``format`` rule on one completion."""
    answer = _last_block(text, answer_tag)
    if not think_tag:
        return 1.0 if answer else 0.0
    think = _first_block(text, think_tag)
    score = 0.0
    if think:
        score += weights[0]
    if answer:
        score += weights[1]
    if think and answer and think[1] <= answer[0]:
        score += weights[2]
    return min(1.0, score)


@register("format")
def format_reward(
    think_tag: str | None = "think", answer_tag: str = "answer", weights: tuple = (0.3, 0.3, 0.4)
):
    """think +0.3, answer +0.3, think before answer +0.4 (``weights`` changes the three parts)."""
    weights = tuple(float(w) for w in weights)
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) > 1.0 + 1e-9:
        raise ValueError(f"weights must be three non-negative numbers summing to at most 1, got {weights}")

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        return format_score(str(completion), think_tag, answer_tag, weights)

    return per_completion(one, "format")


def _check_score(score: float) -> float:
    score = float(score)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"score must be in [0, 1], got {score}")
    return score


_WS = re.compile(r"\s*")


def strict_format_ok(text: str, think_tag: str = "reasoning", answer_tag: str = "answer") -> bool:
    """``re.fullmatch(r"\\s*<r>\\n.*?\\n</r>\\n<a>\\n.*?\\n</a>\\n?", text, re.S)`` in linear time."""
    text = text[_WS.match(text).end() :]
    prefix = f"<{think_tag}>\n"
    suffix = f"\n</{answer_tag}>\n" if text.endswith("\n") else f"\n</{answer_tag}>"
    if not text.startswith(prefix) or not text.endswith(suffix) or len(text) < len(prefix) + len(suffix):
        return False
    return f"\n</{think_tag}>\n<{answer_tag}>\n" in text[len(prefix) : len(text) - len(suffix)]


def soft_format_ok(text: str, think_tag: str = "reasoning", answer_tag: str = "answer") -> bool:
    """``re.match(r"\\s*<r>.*?</r>\\s*<a>.*?</a>", text, re.S)`` in linear time."""
    pos = _WS.match(text).end()
    open_t, close_t = f"<{think_tag}>", f"</{think_tag}>"
    a_open, a_close = f"<{answer_tag}>", f"</{answer_tag}>"
    if not text.startswith(open_t, pos):
        return False
    i = text.find(close_t, pos + len(open_t))
    while i >= 0:  # the earliest "</r> <a>" wins: a later one only leaves less room for "</a>"
        j = _WS.match(text, i + len(close_t)).end()
        if text.startswith(a_open, j):
            return text.find(a_close, j + len(a_open)) >= 0
        i = text.find(close_t, i + 1)
    return False


@register("strict_format")
def strict_format(think_tag: str = "reasoning", answer_tag: str = "answer", score: float = 0.5):
    """Cookbook strict layout: tags on their own lines, reasoning then answer, nothing around."""
    score = _check_score(score)

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        return score if strict_format_ok(str(completion), think_tag, answer_tag) else 0.0

    return per_completion(one, "strict_format")


@register("soft_format")
def soft_format(think_tag: str = "reasoning", answer_tag: str = "answer", score: float = 0.5):
    """Cookbook soft layout: a reasoning block, optional whitespace, an answer block, at the start."""
    score = _check_score(score)

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        return score if soft_format_ok(str(completion), think_tag, answer_tag) else 0.0

    return per_completion(one, "soft_format")


def xml_count_score(text: str, think_tag: str = "reasoning", answer_tag: str = "answer") -> float:
    """The cookbook's ``count_xml`` with configurable tags, clipped to [0, 1]."""
    t, a = think_tag, answer_tag
    count = 0.0
    if text.count(f"<{t}>\n") == 1:
        count += 0.125
    if text.count(f"\n</{t}>\n") == 1:
        count += 0.125
    if text.count(f"\n<{a}>\n") == 1:
        count += 0.125
        count -= len(text.split(f"\n</{a}>\n")[-1]) * 0.001
    if text.count(f"\n</{a}>") == 1:
        count += 0.125
        count -= (len(text.split(f"\n</{a}>")[-1]) - 1) * 0.001
    return min(1.0, max(0.0, count))


@register("xml_count")
def xml_count(think_tag: str = "reasoning", answer_tag: str = "answer"):
    """Partial credit per well-placed tag line (cookbook ``xmlcount_reward_func``)."""

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        return xml_count_score(str(completion), think_tag, answer_tag)

    return per_completion(one, "xml_count")
