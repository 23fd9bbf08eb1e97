"""Built-in rewards: extraction, every family's rule, guards, and a property test over any unicode."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamgrpo.rewards import (
    RewardError,
    builtin_names,
    classify_answer,
    extract_answer,
    first_number,
    get,
    numbers,
    parse_options,
)
from streamgrpo.rewards.format import soft_format_ok, strict_format_ok

QUESTION = "<video>\nWhat colour is the ball?\n(A) red (B) green (C) blue\nAnswer with the option."


def tagged(answer: str, think: str = "look") -> str:
    return f"<think>{think}</think> <answer>{answer}</answer>"


def one(name: str, completion: str, answer: str, **fields) -> float:
    values = get(name)([completion], [answer], **fields)
    assert len(values) == 1
    return values[0]


# ----------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    ("text", "tag", "want"),
    [
        ("<think>x</think><answer> (B) red </answer>", "answer", "(B) red"),
        ("<answer>A</answer> later <answer>C</answer>", "answer", "C"),  # the last one counts
        ("<answer></answer>", "answer", ""),
        ("no tags at all", "answer", None),
        ("<answer>truncated", "answer", None),
        ("<ANSWER>B</ANSWER>", "answer", None),  # tags are case-sensitive
        ("<reasoning>r</reasoning><result>42</result>", "result", "42"),
        ("<answer>a</answer><answer>unclosed", "answer", "a"),
    ],
)
def test_extract_answer(text, tag, want):
    assert extract_answer(text, tag) == want


def test_numbers_as_people_write_them():
    assert numbers("EF is 65.4%, 1,200 cells and -3.5 degrees") == [65.4, 1200.0, -3.5]
    assert first_number("no number here") is None
    assert first_number("between 3-5") == 3.0
    assert first_number("x" + "9" * 400) is None  # no leading word char, and nothing overflows
    assert first_number("9" * 400) is None  # overflows to inf: not a finite number


# --------------------------------------------------------------------------------- numeric
@pytest.mark.parametrize(
    ("truth", "pred", "want"),
    [
        ("EF is 60%", "EF is 60%", 1.0),
        ("EF is 60%", "EF is 55%", 0.964),
        ("30", "30", 1.0),
        ("60", "No number", 0.0),
        ("Good quality", "Excellent", 0.5),
    ],
)
def test_numeric_spec_rows(truth, pred, want):
    assert round(get("numeric")([pred], [truth])[0], 3) == want


def test_numeric_rule_details():
    numeric = get("numeric")
    assert numeric(["<think>maybe 10</think><answer>50</answer>"], ["60"]) == pytest.approx(
        [0.1 + 0.9 * 0.84]
    )
    assert numeric(["<think>I think 60</think> so what"], ["60"]) == [0.0]  # reasoning is not the answer
    assert numeric(["<answer></answer>"], ["60"]) == [0.0]
    assert numeric(["1,200 units"], ["1200"]) == [1.0]
    assert numeric(["99"], ["60"]) == pytest.approx([0.1])  # past the scale: base only
    assert get("numeric", scale=50.0)(["55"], ["60"]) == pytest.approx([0.1 + 0.9 * (1 - 0.01)])
    assert get("numeric", base=0.0)(["85"], ["60"]) == [0.0]
    assert get("numeric", fallback=False)(["60"], ["60"]) == [0.0]
    # Emphasis only ever applies to an exact match, where the value is already capped at 1.
    assert get("numeric", base=0.0, emphasis=0.0)(["60"], ["60"]) == [1.0]
    with pytest.raises(RewardError, match="scale"):
        get("numeric", scale=0)


# ---------------------------------------------------------------------------------- format
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("<think>a</think> <answer>b</answer>", 1.0),
        ("<think>a</think>", 0.3),
        ("<answer>b</answer>", 0.3),
        ("plain text", 0.0),
        ("<answer>b</answer> <think>a</think>", 0.6),  # both present, misordered
        ("<think>a <answer>b</answer></think>", 0.6),  # answer inside the think block
        ("</think> a <think>", 0.0),  # closing before opening is no block
        ("<think>a</think> <answer>b", 0.3),  # unclosed answer
        ("<think>a <answer>b</answer>", 0.3),  # unclosed think
    ],
)
def test_format_combinations(text, want):
    assert one("format", text, "") == pytest.approx(want)


def test_format_tag_names_and_no_think():
    text = "<reasoning>a</reasoning><answer>b</answer>"
    assert get("format", think_tag="reasoning")([text], [""]) == [1.0]
    assert get("format")([text], [""]) == pytest.approx([0.3])
    assert get("format", think_tag=None)(["<answer>b</answer>", "b"], [""]) == [1.0, 0.0]
    assert get("format", answer_tag="final")(["<think>a</think><final>b</final>"], [""]) == [1.0]


COOKBOOK = "<reasoning>\nstep 1\nstep 2\n</reasoning>\n<answer>\n42\n</answer>\n"


@pytest.mark.parametrize(
    ("text", "strict", "soft"),
    [
        (COOKBOOK, 0.5, 0.5),
        (COOKBOOK.rstrip("\n"), 0.5, 0.5),
        ("<reasoning>r</reasoning> <answer>42</answer>", 0.0, 0.5),
        (COOKBOOK + "extra", 0.0, 0.5),
        ("preamble " + COOKBOOK, 0.0, 0.0),
        ("<answer>\n42\n</answer>\n<reasoning>\nr\n</reasoning>\n", 0.0, 0.0),
        ("<reasoning>\nr\n</reasoning>\n", 0.0, 0.0),
    ],
)
def test_cookbook_strict_and_soft(text, strict, soft):
    assert one("strict_format", text, "") == strict
    assert one("soft_format", text, "") == soft


TAG_SOUP = st.lists(st.sampled_from(["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "x", "\t"]),
                    max_size=14).map("".join)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(text=TAG_SOUP)
def test_layout_checks_equal_the_cookbook_regexes(text):
    """The linear scans decide exactly like the cookbook patterns (with DOTALL and leading space)."""
    strict = re.fullmatch(r"\s*<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?", text, re.DOTALL)
    soft = re.match(r"\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", text, re.DOTALL)
    assert strict_format_ok(text) == bool(strict)
    assert soft_format_ok(text) == bool(soft)


def test_xml_count():
    assert one("xml_count", COOKBOOK, "") == pytest.approx(0.5)
    assert one("xml_count", COOKBOOK + "tail", "") == pytest.approx(0.5 - 0.004 - 0.004)
    assert one("xml_count", "<reasoning>\nr\n</reasoning>\n", "") == pytest.approx(0.25)
    assert one("xml_count", "nothing", "") == 0.0
    assert one("xml_count", COOKBOOK + "x" * 2000, "") == 0.0  # cookbook would go negative; clipped
    think = COOKBOOK.replace("reasoning", "think")
    assert get("xml_count", think_tag="think")([think], [""]) == pytest.approx([0.5])


# -------------------------------------------------------------------------------- accuracy
RIGHT = ["B", "(B)", "B)", "B. green", "B: green", "(B) green", "[B]", "b", "green", "Green.", "The answer is B",
         "Answer: (B)", "option B", "The ball is green."]  # fmt: skip
WRONG = ["A", "(A)", "A)", "C. blue", "(C) blue", "red", "Blue.", "The answer is C", "purple"]


@pytest.mark.parametrize("spelling", RIGHT)
@pytest.mark.parametrize("truth", ["(B) green", "B", "green", "B. green"])
def test_accuracy_right_spellings(spelling, truth):
    assert one("accuracy", tagged(spelling), truth, question=QUESTION) == 1.0


@pytest.mark.parametrize("spelling", WRONG)
@pytest.mark.parametrize("truth", ["(B) green", "B", "green"])
def test_accuracy_wrong_spellings(spelling, truth):
    assert one("accuracy", tagged(spelling), truth, question=QUESTION) == 0.0


@pytest.mark.parametrize(("spelling", "want"), [("B", 1.0), ("(B)", 1.0), ("B) Collision", 1.0),
                                                 ("Collision", 1.0), ("collision!", 1.0), ("A", 0.0), ("Crash", 0.0)])  # fmt: skip
def test_accuracy_without_question(spelling, want):
    """The spec's spellings, `B`, `(B)`, `B) Collision`, `Collision`, against a ground truth `(B) Collision`."""
    assert one("accuracy", tagged(spelling), "(B) Collision") == want


MULTI_VIDEO = "<video>\n<video>\n<video>\nWhich video shows the ball moving left? (1) (2) (3)"


@pytest.mark.parametrize(("spelling", "want"), [("(2)", 1.0), ("2", 1.0), ("2)", 1.0), ("Video 2", 1.0),
                                                 ("(1)", 0.0), ("3", 0.0), ("(2) and (3)", 0.0)])  # fmt: skip
def test_accuracy_option_numbers(spelling, want):
    assert one("accuracy", tagged(spelling), "(2)", question=MULTI_VIDEO) == want
    assert one("accuracy", tagged(spelling), "2", question=MULTI_VIDEO) == want


def test_accuracy_non_choice_truths():
    acc = get("accuracy")
    assert acc([tagged("37.5"), tagged("37.50 cm"), tagged("37"), tagged("37.5 or 40")], ["37.5"]) == [
        1,
        1,
        0,
        0,
    ]
    assert acc([tagged("Collision"), tagged("(B) collision"), tagged("no")], ["Collision"]) == [1, 1, 0]
    # the ground truth may be a whole gpt turn: its answer tag is read
    assert acc([tagged("B")], ["<think>because</think> <answer>(B) Collision</answer>"]) == [1.0]


@pytest.mark.parametrize("hedge", ["A or B", "A, C", "B or C", "(A) or (B)", "A and B", "B / C", "(B)(C)",
                                   "B, because (A) is wrong", "green or blue"])  # fmt: skip
def test_guard_several_options_score_zero(hedge):
    assert one("accuracy", tagged(hedge), "(B) green", question=QUESTION) == 0.0


@pytest.mark.parametrize("name", ["accuracy", "action_iou", "numeric", "exact_match"])
def test_guard_empty_answer_scores_zero(name):
    truth = {"accuracy": "(B) green", "action_iou": "(1) Pick up", "numeric": "60", "exact_match": "green"}[
        name
    ]
    assert one(name, "<think>x</think><answer></answer>", truth, question=QUESTION) == 0.0
    assert one(name, "<think>x</think><answer>   </answer>", truth, question=QUESTION) == 0.0


def test_missing_answer_tag_and_fallback():
    assert one("accuracy", "B", "(B) green") == 0.0
    assert get("accuracy", fallback=True)(["<think>maybe A</think> B"], ["(B) green"]) == [1.0]
    assert get("accuracy", answer_tag="result")(["<result>B</result>"], ["(B) green"]) == [1.0]


def test_parse_options():
    assert parse_options(QUESTION).texts == {"A": "red", "B": "green", "C": "blue"}
    lines = "Answer like (A).\nA. a red ball\nB. a green ball"
    assert parse_options(lines).texts == {"A": "a red ball", "B": "a green ball"}
    assert parse_options(MULTI_VIDEO).texts == {"1": "", "2": "", "3": ""}
    assert not parse_options("What is the ejection fraction?").full


def test_classify_answer():
    assert classify_answer("(B) red") == "choice"
    assert classify_answer("green", QUESTION) == "choice"
    assert classify_answer("purple", QUESTION) == "text"
    assert classify_answer("(1) Pick up (2) Rotate") == "actions"
    assert classify_answer("37.5") == "numeric"
    assert classify_answer("Collision") == "text"
    assert classify_answer("<answer></answer>") == "empty"


# ------------------------------------------------------------------------------ action_iou
@pytest.mark.parametrize(
    ("pred", "want"),
    [
        ("(1) Pick up (2) Rotate", 1.0),
        ("(1) rotate (2) pick up", 1.0),  # same set, other order and case
        ("Pick up, Rotate", 1.0),
        ("1. Pick up\n2. Rotate", 1.0),
        ("(1) Drop (2) Push", 0.0),  # disjoint
        ("(1) Pick up (2) Drop", 1 / 3),  # overlap 1, union 3
        ("(1) Pick up", 0.5),
        ("(1) Pick up (2) Rotate (3) Drop (4) Push", 0.5),
    ],
)
def test_action_iou(pred, want):
    assert one("action_iou", tagged(pred), "(1) Pick up (2) Rotate") == pytest.approx(want)


# ----------------------------------------------------------------------------- exact_match
def test_exact_match():
    em = get("exact_match")
    assert em([tagged("Red ball!"), tagged("red  ball"), tagged("red"), "red ball"], ["red ball"]) == [
        1,
        1,
        0,
        0,
    ]
    assert get("exact_match", case_sensitive=True)(
        [tagged("Red ball"), tagged("red ball")], ["red ball"]
    ) == [0, 1]


# ----------------------------------------------------------------------------- registry
def test_registry_errors():
    assert {"format", "strict_format", "soft_format", "xml_count", "accuracy", "action_iou", "numeric",
            "exact_match"} <= set(builtin_names())  # fmt: skip
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        get("nope")
    with pytest.raises(RewardError, match="unknown parameter"):
        get("accuracy", colour="red")
    with pytest.raises(RewardError, match="cannot import module"):
        get("no_such_module_xyz:fn")
    with pytest.raises(RewardError, match="has no"):
        get("math:no_such_function")
    assert get("accuracy_reward")([tagged("B")], ["B"]) == [1.0]  # seed-era alias


def test_batched_interface():
    acc = get("accuracy")
    # one shared answer or one per completion; the question may be shared or per completion
    assert acc([tagged("B"), tagged("A")], ["B"]) == [1.0, 0.0]
    assert acc([tagged("green"), tagged("green")], ["B", "A"], question=[QUESTION, QUESTION]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="3 answers for 2 completions"):
        acc(["a", "b"], ["a", "b", "c"])


# ------------------------------------------------------------------------------ properties
TRUTHS = ["(B) green", "B", "green", "(2)", "37.5", "EF is 60%", "Good quality", "(1) Pick up (2) Rotate", "",
          "<think>t</think><answer>(A) red</answer>"]  # fmt: skip
FRAGMENTS = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<reasoning>", "</reasoning>", "\n",
                             "(B)", "A or B", "1,200", "-3.5%", "9" * 400, "green", " "])  # fmt: skip
COMPLETIONS = st.one_of(
    st.text(), st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=30).map("".join)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    completion=COMPLETIONS,
    truth=st.sampled_from(TRUTHS),
    question=st.sampled_from([None, QUESTION, MULTI_VIDEO]),
)
def test_any_unicode_completion_scores_finite_in_unit_interval(completion, truth, question):
    for name in builtin_names():
        value = get(name)([completion], [truth], question=question)[0]
        assert isinstance(value, float) and math.isfinite(value), (name, completion, value)
        assert 0.0 <= value <= 1.0, (name, completion, value)


def test_done_when_command_and_no_torch():
    """The issue's check prints 0.964, and importing the rewards package pulls in no torch."""
    import subprocess
    import sys

    code = (
        "import sys; from streamgrpo.rewards import get; "
        "print(get('numeric')(['EF is 55%'], ['EF is 60%'])); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    values, torch_loaded = out.stdout.strip().splitlines()
    assert round(json.loads(values)[0], 3) == 0.964
    assert torch_loaded == "False"
