"""``accuracy`` per question kind against Video-R1's formulas (and VSI-Bench's mean relative accuracy)."""

from __future__ import annotations

import pytest

from streamgrpo.rewards import RewardError, get
from streamgrpo.rewards.problem_types import VIDEO_R1, mra_score, number_score, relative_score

pytest.importorskip("jiwer")
pytest.importorskip("rouge_score")


def acc(pred: str, truth: str, kind: str | None, **params) -> float:
    return get("accuracy", **params)([f"<think>t</think><answer>{pred}</answer>"], [truth], kind=kind)[0]


def test_issue_examples_get_video_r1_partial_credit():
    # OCR: one substituted word of two -> 1 - WER = 0.5
    assert acc("HELO WORLD", "HELLO WORLD", "OCR") == pytest.approx(0.5)
    # free-form: mean of ROUGE-1 (2/3), ROUGE-2 (2/7), ROUGE-L (2/3) F-measures
    assert acc("it moves to the right side", "it moves right", "free-form") == pytest.approx(
        (2 / 3 + 2 / 7 + 2 / 3) / 3)
    # regression: 1 - |2.4 - 2.5| / 2.5
    assert acc("2.4", "2.5", "regression") == pytest.approx(0.96)


def test_multiple_choice_and_numerical_are_exact():
    q = "Which?\nOptions:\nA. red\nB. green"
    assert get("accuracy")(["<answer>B</answer>"], ["<answer>B</answer>"], kind="multiple choice",
                           question=q) == [1.0]
    assert get("accuracy")(["<answer>A</answer>"], ["<answer>B</answer>"], kind="multiple choice",
                           question=q) == [0.0]
    assert acc("3", "3", "numerical") == 1.0
    assert acc("3.001", "3.0", "numerical") == 1.0  # equal at 2 decimals
    assert acc("3", "3.0", "numerical") == 0.0  # Video-R1: a decimal point in one only -> 0
    assert acc("4", "3", "numerical") == 0.0
    assert acc("three", "3", "numerical") == 0.0


def test_ocr_wer_clipped():
    assert acc("HELLO WORLD", "HELLO WORLD", "OCR") == 1.0
    assert acc("a b c d e", "HELLO", "OCR") == 0.0  # WER 5 -> clipped at 0
    assert acc("HELLO", "HELLO WORLD", "OCR") == pytest.approx(0.5)


def test_regression_relative_and_mra():
    assert relative_score("5", "2.5") == 0.0  # 100 % off -> clipped at 0
    assert relative_score("x", "2.5") == 0.0
    # VSI-Bench MRA: thresholds .50 ... .95, correct at theta when rel <= 1 - theta
    assert mra_score("10", "10") == 1.0
    assert mra_score("11.2", "10") == pytest.approx(0.8)  # rel 0.12: theta 0.50 ... 0.85
    assert mra_score("12.8", "10") == pytest.approx(0.5)  # rel 0.28: theta 0.50 ... 0.70
    assert mra_score("16", "10") == 0.0
    assert acc("12.8", "10", "regression", by_kind={"regression": "mra"}) == pytest.approx(0.5)


def test_kinds_case_insensitive_and_unknown_kind_uses_choice():
    assert acc("HELO WORLD", "HELLO WORLD", "ocr") == pytest.approx(0.5)
    assert acc("HELO WORLD", "HELLO WORLD", "caption") == 0.0  # default: choice/exact text
    assert acc("HELO WORLD", "HELLO WORLD", None) == 0.0
    # the choice per kind is the config's: OCR scored as exact text
    assert acc("HELO WORLD", "HELLO WORLD", "OCR", by_kind={"OCR": "choice"}) == 0.0
    assert acc("it moves", "it moves right", "caption", default="rouge") > 0.0


def test_empty_answer_scores_zero_and_bad_rules_are_refused():
    assert get("accuracy")(["<answer> </answer>"], ["HELLO"], kind="OCR") == [0.0]
    assert get("accuracy")(["no tags at all"], ["2.5"], kind="regression") == [0.0]
    with pytest.raises(RewardError, match="unknown rule 'bleu'"):
        get("accuracy", by_kind={"OCR": "bleu"})
    with pytest.raises(RewardError, match="by_kind must be a mapping"):
        get("accuracy", by_kind=["OCR"])


def test_per_completion_kinds_and_defaults_cover_video_r1():
    assert set(VIDEO_R1) == {"multiple choice", "numerical", "OCR", "free-form", "regression"}
    fn = get("accuracy")
    out = fn(["<answer>2.4</answer>", "<answer>2.4</answer>"], ["2.5"], kind=["regression", "numerical"])
    assert out == [pytest.approx(0.96), 0.0]
    assert number_score("1,200", "1200") == 1.0


def test_eval_scores_regression_by_mra_over_the_training_rules():
    from streamgrpo.config import RewardsConfig
    from streamgrpo.evaluator.scoring import eval_rewards
    from streamgrpo.rewards import RewardSet

    train = RewardsConfig.model_validate([{"name": "format", "weight": 0.3}, {"name": "accuracy", "weight": 0.7}])
    evaluated = eval_rewards(train, {"regression": "mra"})
    assert evaluated.functions[1].params["by_kind"] == {**VIDEO_R1, "regression": "mra"}
    assert train.functions[1].params == {}  # the training section is not changed
    scored = RewardSet(evaluated).score(["<answer>12.8</answer>"], "10", fields={"kind": "regression"})
    assert scored.for_completion(0)["accuracy"] == pytest.approx(0.5)  # MRA, not 1 - 0.28
    assert RewardSet(train).score(["<answer>12.8</answer>"], "10", fields={"kind": "regression"}
                                  ).for_completion(0)["accuracy"] == pytest.approx(0.72)
    assert eval_rewards(train, {}) is train


def test_a_missing_library_is_named_with_its_package(monkeypatch):
    import sys

    from streamgrpo.rewards import RewardSet

    monkeypatch.setitem(sys.modules, "jiwer", None)  # as if not installed
    with pytest.raises(RewardError, match=r"kind 'ocr': accuracy rule 'wer' needs the jiwer package \(pip install jiwer"):
        get("accuracy", by_kind={"OCR": "wer"})
    fn = get("accuracy")  # the default rules: refused only when an OCR record is scored
    assert fn(["<answer>B</answer>"], ["B"], kind="multiple choice") == [1.0]
    scored = RewardSet([{"name": "accuracy"}]).score(["<answer>HELO</answer>"], "HELLO", fields={"kind": "OCR"})
    assert scored.for_completion(0)["accuracy"] == 0.0 and "needs the jiwer package" in str(scored.errors)
