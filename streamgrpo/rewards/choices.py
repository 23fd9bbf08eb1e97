"""Multiple-choice parsing: options listed in a question, and the option(s) an answer names.

Options are labelled with capital letters ``(A) red (B) green`` / ``A. red`` on their own lines,
or with numbers ``(1) (2) (3)`` (multi-video questions). An answer names an option by

* its label: ``B``, ``(B)``, ``[B]``, ``B)``, ``B. red``, ``B: red``, ``(2)``, ``2)``, ``2``,
  optionally after ``answer:`` / ``the answer is`` / ``option``;
* or its text: ``red`` matches ``(B) red`` (exact, case- and punctuation-insensitive); when the
  question lists the full option set, a sentence containing exactly one option text counts too
  (``The ball is red.``).

:func:`named_options` returns every option an answer names, so callers can apply the guard
"several options named (``A or B``, ``A, C``) scores 0".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .extract import normalize

_L = r"(?:[A-Z]|\d{1,2})"
# Option markers in a question: "(A)" anywhere, or "A." / "A)" / "1." at a line start.
_Q_MARK = re.compile(rf"\(\s*({_L})\s*\)|(?m:^)[ \t]*({_L})[.)][ \t]")


# The last option's text ends at its line end or sentence end ("(C) blue. Answer with ...").
_LAST_END = re.compile(r"\n|[.?!](?:\s|$)")


@dataclass
class Options:
    """Option labels in order with their normalised texts (text may be empty, e.g. ``(1) (2)``)."""

    texts: dict[str, str] = field(default_factory=dict)
    full: bool = False  # True when the question listed the whole option set

    @property
    def labels(self) -> list[str]:
        return list(self.texts)


def _label_kind(label: str) -> str:
    return "number" if label.isdigit() else "letter"


def _next(label: str) -> str:
    return str(int(label) + 1) if label.isdigit() else chr(ord(label) + 1)


def parse_options(question: str | None) -> Options:
    """The longest run of consecutive option labels (A, B, C ... or 1, 2, 3 ...) in ``question``.

    A run needs two labels or more; the text of the last option ends at the end of its line or
    sentence.
    Mentions outside the run (``answer with (A)``) are ignored.
    """
    if not question or not isinstance(question, str):
        return Options()
    marks = [(m.group(1) or m.group(2), m.start(), m.end()) for m in _Q_MARK.finditer(question)]
    best: list[tuple[str, int, int]] = []
    i = 0
    while i < len(marks):
        if marks[i][0] not in ("A", "1"):
            i += 1
            continue
        run = [marks[i]]
        j = i + 1
        while j < len(marks) and marks[j][0] == _next(run[-1][0]):
            run.append(marks[j])
            j += 1
        if len(run) > len(best):
            best = run
        i = j if len(run) > 1 else i + 1
    if len(best) < 2:
        return Options()
    texts: dict[str, str] = {}
    for k, (label, _start, end) in enumerate(best):
        if k + 1 < len(best):
            raw = question[end : best[k + 1][1]]
        else:
            raw = _LAST_END.split(question[end:], maxsplit=1)[0]
        texts[label] = normalize(raw)
    return Options(texts=texts, full=True)


_PREFIX = re.compile(
    r"^\s*(?:(?:the|my)\s+)?(?:final\s+|correct\s+|best\s+)?(?:answer|option|choice|video)s?\s*(?:is|would\s+be|:|-)?\s*:?\s*",
    re.IGNORECASE,
)
# The whole answer is one label or a list of labels: "B", "(b)", "A or B", "A, C", "(1) and (3)".
_ONE = r"[\(\[]?\s*(?:[A-Za-z]|\d{1,2})\s*[\)\]]?"
_LIST = re.compile(
    rf"^\s*{_ONE}(?:\s*(?:,|;|/|&|\+|\bor\b|\band\b|\bor\s+maybe\b)\s*{_ONE})*\s*[.!]?\s*$", re.IGNORECASE
)
_LABEL_IN = re.compile(r"(?<![A-Za-z\d])([A-Za-z]|\d{1,2})(?![A-Za-z\d])")
# A label opening the answer, followed by its text: "(B) red", "[B] red", "B) red", "B. red", "B: red", "2) x".
_LEAD = re.compile(r"^\s*(?:[\(\[]\s*([A-Za-z]|\d{1,2})\s*[\)\]]|([A-Z]|\d{1,2})\s*[).:](?=\s|$)(?!\s*\d))")
_LEAD_AFTER_PREFIX = re.compile(r"^\s*([A-Z]|\d{1,2})(?=\s|$|[,;!?])")
# A parenthesised capital label anywhere: "... so (B)".
_PAREN_ANY = re.compile(r"[\(\[]\s*([A-Z]|\d{1,2})\s*[\)\]]")


def _canon(label: str) -> str:
    return label.upper() if label.isalpha() else str(int(label))


def lead_label(answer: str) -> tuple[str | None, str]:
    """The label opening ``answer`` (``"(B) red"`` -> ``("B", "red")``) or ``(None, answer)``."""
    text = answer
    m = _PREFIX.match(text)
    prefixed = m is not None
    if m is not None:
        text = text[m.end() :]
    m = _LEAD.match(text)
    if m:
        return _canon(m.group(1) or m.group(2)), text[m.end() :].strip()
    if prefixed:
        m = _LEAD_AFTER_PREFIX.match(text)
        if m:
            return _canon(m.group(1)), text[m.end() :].strip()
    return None, answer


def named_options(answer: str, options: Options, kind: str | None = None) -> list[str]:
    """Every option label ``answer`` names, in order of first mention (empty: it names none).

    ``kind`` (``"letter"`` / ``"number"``) restricts labels to the ground truth's kind; labels
    outside a known option set are ignored.
    """
    valid = set(options.texts) if options.full else None

    def keep(label: str) -> bool:
        if kind is not None and _label_kind(label) != kind:
            return False
        return valid is None or label in valid

    found: list[str] = []

    def add(label: str) -> None:
        label = _canon(label)
        if keep(label) and label not in found:
            found.append(label)

    body = answer
    m = _PREFIX.match(body)
    if m is not None:
        body = body[m.end() :]
    if _LIST.match(body):
        for lab in _LABEL_IN.findall(body):  # single letters only: "or"/"and" are not labels
            add(lab)
    lead, _rest = lead_label(answer)
    if lead is not None:
        add(lead)
    for lab in _PAREN_ANY.findall(answer):
        add(lab)
    if found:
        return found
    # No label: match option texts.
    norm = normalize(answer)
    if not norm:
        return []
    by_text = [lab for lab, text in options.texts.items() if text and text == norm and keep(lab)]
    if by_text or not options.full:
        return by_text
    padded = f" {norm} "
    hits = [lab for lab, text in options.texts.items() if text and f" {text} " in padded and keep(lab)]
    # "dark red" contains "red": keep only the longest of nested option texts.
    return [
        lab
        for lab in hits
        if not any(other != lab and options.texts[lab] in options.texts[other] for other in hits)
    ]
