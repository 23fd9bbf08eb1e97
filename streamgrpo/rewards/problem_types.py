"""How ``accuracy`` scores each question kind (Video-R1's ``problem_type``): pure rules on answer texts.

A record's kind (``problem_type`` in Video-R1's JSON, ``meta.kind`` elsewhere) picks a *rule* through
the ``accuracy`` reward's ``by_kind`` parameter; kinds it does not name use ``default`` (``choice``).

=============  ===============================================================================
rule           score of an extracted answer against the ground truth
=============  ===============================================================================
``choice``     1 when the answer picks the ground-truth option (or equals a non-option truth), else 0
``number``     1 when both are one number, equal after rounding to 2 decimals, and both or neither
               written with a decimal point (Video-R1's ``numerical``), else 0
``wer``        1 - word error rate (``jiwer``), clipped to [0, 1] (Video-R1's ``OCR``)
``rouge``      mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L, stemmed (``rouge-score``; Video-R1's
               ``free-form``)
``relative``   1 - |pred - truth| / |truth|, clipped to [0, 1] (Video-R1's ``regression``)
``mra``        VSI-Bench's mean relative accuracy: the share of the thresholds 0.50, 0.55, ... 0.95
               with |pred - truth| / |truth| <= 1 - threshold (``eval`` scores ``regression`` so)
=============  ===============================================================================

:data:`VIDEO_R1` is the default ``by_kind``: Video-R1's five problem types. Kinds are matched
case-insensitively. ``wer`` and ``rouge`` import their library when a reward naming them in
``by_kind`` is built (with the default ``by_kind``: when a record of that kind is first scored).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

from .extract import is_number_only, numbers

VIDEO_R1: dict[str, str] = {
    "multiple choice": "choice",
    "numerical": "number",
    "OCR": "wer",
    "free-form": "rouge",
    "regression": "relative",
}
"""Video-R1's problem types and the rule of each (its ``accuracy_reward``)."""

EVAL_OVERRIDES: dict[str, str] = {"regression": "mra"}
"""What ``eval`` and the evaluator score differently from training (VSI-Bench's metric)."""

_LIBRARIES = {"wer": ("jiwer", "jiwer"), "rouge": ("rouge_score.rouge_scorer", "rouge-score")}
_DECIMAL = re.compile(r"\d\.\d")


def _library(rule: str):
    """The module rule ``rule`` scores with, or ImportError saying which package to install."""
    import importlib

    module, package = _LIBRARIES[rule]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"accuracy rule {rule!r} needs the {package} package (pip install {package}; "
                          "`make setup` installs it)") from None


def one_number(text: str) -> float | None:
    """The number ``text`` is (``12``, ``1,200``, ``3.5%``), or None when it is not exactly one number."""
    if not is_number_only(text):
        return None
    found = numbers(text)
    return found[0] if len(found) == 1 else None


def number_score(pred: str, truth: str) -> float:
    """Video-R1's ``numerical``: equal at 2 decimals, and the same use of a decimal point."""
    want, got = one_number(truth), one_number(pred)
    if want is None or got is None:
        return 0.0
    if bool(_DECIMAL.search(truth)) != bool(_DECIMAL.search(pred)):
        return 0.0
    return 1.0 if round(want, 2) == round(got, 2) else 0.0


def wer_score(pred: str, truth: str) -> float:
    """1 - word error rate of ``pred`` against ``truth`` (jiwer), clipped to [0, 1]."""
    jiwer = _library("wer")
    if not truth.split():
        return 1.0 if not pred.split() else 0.0
    if not pred.split():
        return 0.0
    return min(1.0, max(0.0, 1.0 - float(jiwer.wer(truth, pred))))


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    return _library("rouge").RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_score(pred: str, truth: str) -> float:
    """Mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L (stemmed), as Video-R1 scores free-form answers."""
    scores = _rouge_scorer().score(truth, pred)
    mean = (scores["rouge1"].fmeasure + scores["rouge2"].fmeasure + scores["rougeL"].fmeasure) / 3.0
    return min(1.0, max(0.0, float(mean)))


def relative_score(pred: str, truth: str) -> float:
    """1 - relative error, clipped to [0, 1] (Video-R1's ``regression``; ``2.4`` for ``2.5`` -> 0.96)."""
    want, got = one_number(truth), one_number(pred)
    if want is None or got is None:
        return 0.0
    rel = (abs(got - want) + 1e-9) / (abs(want) + 1e-9)
    return 1.0 - min(1.0, max(0.0, rel))


MRA_THRESHOLDS = tuple(round(0.5 + 0.05 * k, 2) for k in range(10))


def mra_score(pred: str, truth: str) -> float:
    """VSI-Bench's mean relative accuracy over the thresholds 0.50 ... 0.95 (a share of 10)."""
    want, got = one_number(truth), one_number(pred)
    if want is None or got is None or want == 0:
        return 0.0
    rel = abs(got - want) / abs(want)
    return sum(rel <= 1.0 - t for t in MRA_THRESHOLDS) / len(MRA_THRESHOLDS)


TEXT_RULES: dict[str, Callable[[str, str], float]] = {
    "number": number_score,
    "wer": wer_score,
    "rouge": rouge_score,
    "relative": relative_score,
    "mra": mra_score,
}
"""The rules that compare answer text to ground-truth text (``choice`` also reads the question)."""

RULES = ("choice", *TEXT_RULES)


def check_rules(by_kind: Mapping[str, str], default: str, *, libraries: bool = True) -> dict[str, str]:
    """``by_kind`` with lower-cased kinds; ValueError naming an unknown rule or (``libraries``) a missing
    library. Without ``libraries`` a missing one raises when a record of that kind is scored."""
    if not isinstance(by_kind, Mapping):
        raise ValueError(f"by_kind must be a mapping of kind -> rule, got {type(by_kind).__name__}")
    out = {str(k).strip().lower(): str(v) for k, v in by_kind.items()}
    for kind, rule in [*out.items(), ("(default)", default)]:
        if rule not in RULES:
            raise ValueError(f"kind {kind!r}: unknown rule {rule!r}; rules: {', '.join(RULES)}")
        if libraries and rule in _LIBRARIES:
            try:
                _library(rule)
            except ImportError as exc:
                raise ValueError(f"kind {kind!r}: {exc}") from None
    return out


def rule_for(kind: object, by_kind: Mapping[str, str], default: str) -> str:
    """The rule of one record's kind (``by_kind`` from :func:`check_rules`)."""
    if kind is None:
        return default
    return by_kind.get(str(kind).strip().lower(), default)
