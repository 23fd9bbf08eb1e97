"""``accuracy``: 1.0 when the answer picks the ground-truth option, else 0.0 -- or, by question kind, the
rule ``by_kind`` names for it (Video-R1's five problem types by default: OCR by word error rate,
free-form by ROUGE, regression by relative error; see :mod:`.problem_types`).

Ground truth forms: ``(B) red``, ``B``, ``B. red``, ``(2)``, or an option text (``red``) when the
question lists the options (``fields["question"]``: ``(A) red (B) green (C) blue``). A ground
truth that is not an option (``Collision`` without options, ``37.5``) is compared as text after
normalisation, or as a number when it is one number.

Guards against reward hacking (score 0): no ``<answer>`` block (unless ``fallback``), an empty
answer, an answer naming several options (``A or B``, ``A, C``, ``(A) ... (B)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from .choices import Options, _label_kind, lead_label, named_options, parse_options
from .extract import answer_text, field_at, is_number_only, normalize, numbers, per_completion, truth_text
from .problem_types import TEXT_RULES, VIDEO_R1, check_rules, rule_for
from .registry import register

_QUESTION_FALLBACKS = ("question", "problem")


@functools.lru_cache(maxsize=512)
def _options_of(question: str) -> Options:
    return parse_options(question)


def question_of(fields: Mapping[str, Any], key: str, i: int, n: int) -> str | None:
    """The question text for completion ``i`` (``fields[key]``, else ``fields["problem"]``)."""
    for k in (key, *_QUESTION_FALLBACKS):
        value = field_at(fields, k, i, n)
        if isinstance(value, str) and value:
            return value
    return None


def truth_choice(truth: str, question: str | None) -> tuple[str | None, Options]:
    """The ground truth's option label (or ``None`` if it is not an option) and the option set.

    The option set is the question's, completed with the ground truth's own ``(B) text`` pair so
    that the text alone matches even without a question.
    """
    opts = _options_of(question) if question else Options()
    if not opts.full and is_number_only(truth):
        return None, opts
    named = named_options(truth, opts)
    if len(named) != 1:
        return None, opts
    label = named[0]
    lead, rest = lead_label(truth)
    if lead == label and rest and not opts.texts.get(label):
        opts = Options(texts={**opts.texts, label: normalize(rest)}, full=opts.full)
    return label, opts


def match_text(pred: str, truth: str) -> bool:
    """Non-option ground truth: one equal number, or equal normalised text (a leading label ignored)."""
    if is_number_only(truth):
        want = numbers(truth)
        got = set(numbers(pred))
        return len(got) == 1 and bool(want) and math.isclose(got.pop(), want[0], rel_tol=1e-9, abs_tol=1e-9)
    norm_truth = normalize(truth)
    if not norm_truth:
        return False
    if normalize(pred) == norm_truth:
        return True
    _lead, rest = lead_label(pred)
    return bool(rest) and normalize(rest) == norm_truth


def score_choice(pred: str | None, truth: str, question: str | None) -> float:
    """Accuracy of one extracted answer against one ground truth (see the module docstring)."""
    if pred is None or not pred.strip() or not truth.strip():
        return 0.0
    label, opts = truth_choice(truth, question)
    if label is None:
        return 1.0 if match_text(pred, truth) else 0.0
    named = named_options(pred, opts, kind=_label_kind(label))
    return 1.0 if named == [label] else 0.0


@register("accuracy")
def accuracy(
    answer_tag: str = "answer",
    think_tag: str | None = "think",
    fallback: bool = False,
    question_field: str = "question",
    by_kind: Mapping[str, str] | None = None,
    default: str = "choice",
    kind_field: str = "kind",
):
    """Accuracy by question kind; ``fallback=True`` reads the whole completion when no answer tag.

    ``by_kind``: question kind (``problem_type``) -> rule (``choice``, ``number``, ``wer``, ``rouge``,
    ``relative``, ``mra``); null: Video-R1's five types. Other kinds are scored by ``default``."""
    rules = check_rules(VIDEO_R1 if by_kind is None else by_kind, default, libraries=by_kind is not None)

    def one(completion: str, answer: Any, fields: Mapping[str, Any], i: int, n: int) -> float:
        pred = answer_text(completion, answer_tag=answer_tag, think_tag=think_tag, fallback=fallback)
        truth = truth_text(answer, answer_tag)
        rule = rule_for(field_at(fields, kind_field, i, n), rules, default)
        if rule != "choice":
            if pred is None or not pred.strip() or not truth.strip():
                return 0.0
            return TEXT_RULES[rule](pred.strip(), truth.strip())
        return score_choice(pred, truth, question_of(fields, question_field, i, n))

    return per_completion(one, "accuracy")


def classify_answer(answer: Any, question: str | None = None, answer_tag: str = "answer") -> str:
    """What kind of ground truth this is, for ``streamgrpo data check``.

    ``"choice"`` (an option), ``"actions"`` (a list of ``(n) action`` items), ``"numeric"``,
    ``"text"`` (compared as normalised text) or ``"empty"`` (no reward can score it).
    """
    from .action_iou import parse_actions

    truth = truth_text(answer, answer_tag)
    if not normalize(truth):
        return "empty"
    label, _opts = truth_choice(truth, question)
    if label is not None:
        return "choice"
    if len(parse_actions(truth)) > 1:
        return "actions"
    if numbers(truth):
        return "numeric"
    return "text"
