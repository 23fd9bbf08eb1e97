"""RewardSet: weighted total, per-function values, custom rewards, robustness, debug log, metrics."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from streamgrpo.config import RewardsConfig, build_config
from streamgrpo.rewards import RewardError, RewardSet, get

PLUGIN = "test_rewards_plugin"
QUESTION = "What colour? (A) red (B) green (C) blue"
GOOD = "<think>it is green</think> <answer>(B)</answer>"
BAD = "<answer>A</answer>"


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    """Make ``test_rewards_plugin`` importable whatever pytest's import mode."""
    # Kept on purpose: a user's reward plugin folder on sys.path is the case under test here.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def errors() -> float:
    return REGISTRY.get_sample_value("streamgrpo_errors_total", {"kind": "reward"}) or 0.0


def reward_count(fn: str) -> float:
    return REGISTRY.get_sample_value("streamgrpo_reward_count", {"fn": fn}) or 0.0


def make(functions, **kw) -> RewardSet:
    return RewardSet(RewardsConfig(functions=functions, **kw))


# ------------------------------------------------------------------------------- combining
def test_default_set_weighted_sum_and_metrics():
    rs = RewardSet.from_config(RewardsConfig())
    assert rs.names == ["format", "accuracy"]
    before_total, before_fmt = reward_count("total"), reward_count("format")
    scored = rs.score([GOOD, BAD, "nothing"], "(B) green", prompt_id="p1", fields={"question": QUESTION})
    assert scored.per_fn["format"] == pytest.approx([1.0, 0.3, 0.0])
    assert scored.per_fn["accuracy"] == [1.0, 0.0, 0.0]
    assert scored.totals == pytest.approx([0.3 * 1.0 + 0.7 * 1.0, 0.3 * 0.3, 0.0])
    assert scored.for_completion(1) == {"format": pytest.approx(0.3), "accuracy": 0.0}
    assert not scored.errors
    assert reward_count("total") == before_total + 3
    assert reward_count("format") == before_fmt + 3


def test_repeated_names_kept_apart_and_params():
    rs = make(
        [
            {"name": "numeric", "weight": 1.0},
            {"name": "numeric", "weight": 2.0, "params": {"scale": 50.0}},
        ]
    )
    assert rs.names == ["numeric", "numeric#2"]
    scored = rs.score(["55"], "60")
    assert scored.per_fn["numeric"] == pytest.approx([0.964])
    assert scored.per_fn["numeric#2"] == pytest.approx([0.1 + 0.9 * 0.99])
    assert scored.totals == pytest.approx([0.964 + 2 * (0.1 + 0.9 * 0.99)])


def test_full_config_passes_tag_names():
    cfg = build_config(
        {"data": {"think_tag": "reasoning"}, "rewards": [{"name": "format"}, {"name": "xml_count"}]}
    )
    rs = RewardSet.from_config(cfg)
    text = "<reasoning>\nr\n</reasoning>\n<answer>\nB\n</answer>\n"
    assert rs.score([text], "B").per_fn == {"format": [1.0], "xml_count": [0.5]}
    no_think = build_config({"data": {"prompt_format": "no_think"}, "rewards": [{"name": "format"}]})
    assert RewardSet(no_think).score(["<answer>B</answer>"], "B").totals == [1.0]


def test_bad_name_or_param_fails_at_build():
    with pytest.raises(RewardError, match="unknown reward"):
        make([{"name": "acuracy"}])
    with pytest.raises(RewardError, match="unknown parameter"):
        make([{"name": "format", "params": {"thinktag": "x"}}])


def test_empty_group():
    scored = RewardSet().score([], "B")
    assert scored.totals == [] and scored.per_fn == {"format": [], "accuracy": []}


# --------------------------------------------------------------------------------- custom
def test_custom_reward_by_import_path():
    fn = get(f"{PLUGIN}:length_reward", scale=4.0)
    assert fn(["ab", "abcdefgh"], ["x", "x"]) == [0.5, 1.0]
    rs = make(
        [
            {"name": f"{PLUGIN}:length_reward", "weight": 0.5, "params": {"scale": 4.0}},
            {"name": f"{PLUGIN}:question_echo"},
            {"name": f"{PLUGIN}:trl_style"},
        ]
    )
    scored = rs.score(["ab", "B"], "B", fields={"question": "ab"})
    assert scored.per_fn[f"{PLUGIN}:length_reward"] == [0.5, 0.25]
    assert scored.per_fn[f"{PLUGIN}:question_echo"] == [1.0, 0.0]  # fields arrive as per-completion lists
    assert scored.per_fn[f"{PLUGIN}:trl_style"] == [0.0, 1.0]  # answers reach a `solution` parameter
    assert not scored.errors


# ----------------------------------------------------------------------------- robustness
@pytest.mark.parametrize(
    ("fn", "message", "want"),
    [
        ("boom", "raised RuntimeError: reward exploded", [0.0, 0.0, 0.0, 0.0]),
        ("too_short", "returned 3 values for 4 completions", [0.0, 0.0, 0.0, 0.0]),
        ("not_finite", "non-finite or non-numeric", [0.0, 0.0, 0.5, 0.0]),
        ("not_a_list", "returned float", [0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_broken_reward_scores_zero_logs_and_counts(fn, message, want, caplog):
    rs = make([{"name": "format", "weight": 1.0}, {"name": f"{PLUGIN}:{fn}", "weight": 1.0}])
    before = errors()
    completions = [GOOD, GOOD, GOOD, GOOD]
    with caplog.at_level(logging.WARNING, logger="streamgrpo.rewards"):
        scored = rs.score(completions, "B", prompt_id="p7")
    key = f"{PLUGIN}:{fn}"
    assert scored.per_fn[key] == want
    assert scored.per_fn["format"] == [1.0] * 4  # the others keep going
    assert scored.totals == pytest.approx([1.0 + w for w in want])
    assert message in scored.errors[key]
    assert errors() == before + 1
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(lines) == 1 and message in lines[0] and "p7" in lines[0]


def test_timeout_does_not_hang(caplog):
    from test_rewards_plugin import RELEASE

    rs = make([{"name": "format"}, {"name": f"{PLUGIN}:hangs"}], timeout_s=0.2)
    before = errors()
    try:
        with caplog.at_level(logging.WARNING, logger="streamgrpo.rewards"):
            scored = rs.score([GOOD, BAD], "B", prompt_id="slow")
        assert scored.per_fn[f"{PLUGIN}:hangs"] == [0.0, 0.0]
        assert scored.per_fn["format"] == pytest.approx([1.0, 0.3])
        assert "timed out after 0.2s" in scored.errors[f"{PLUGIN}:hangs"]
        assert errors() == before + 1
        assert any("timed out" in r.getMessage() and "hangs" in r.getMessage() for r in caplog.records)
        # Calls that keep hanging are abandoned; past MAX_ABANDONED the function is skipped.
        from streamgrpo.rewards.combine import MAX_ABANDONED

        for _ in range(MAX_ABANDONED):
            scored = rs.score([GOOD], "B")
        assert "skipped" in scored.errors[f"{PLUGIN}:hangs"]
    finally:
        RELEASE.set()
    for m in rs.members:
        for thread in m.abandoned:
            thread.join(10.0)
            assert not thread.is_alive()
    assert rs.score([GOOD], "B").per_fn[f"{PLUGIN}:hangs"] == [1.0]  # recovers once they finish
    RELEASE.clear()


# ------------------------------------------------------------------------------ debug log
def test_debug_log_lines(tmp_path):
    path = tmp_path / "logs" / "rewards.jsonl"
    rs = make([{"name": "format", "weight": 0.3}, {"name": "accuracy", "weight": 0.7}], debug_log=str(path))
    rs.score([GOOD, BAD], "(B) green", prompt_id="vid-1", fields={"question": QUESTION})
    rs.score(["x"], "A", prompt_id="vid-2")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt_id"] for r in rows] == ["vid-1", "vid-1", "vid-2"]
    assert rows[0]["completion"] == GOOD and rows[0]["answer"] == "(B) green"
    assert rows[0]["rewards"] == {"format": 1.0, "accuracy": 1.0}
    assert rows[0]["reward"] == pytest.approx(1.0)
    assert rows[1]["rewards"]["accuracy"] == 0.0 and rows[1]["reward"] == pytest.approx(0.09)


def test_unwritable_debug_log_counts_and_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rs = make([{"name": "format"}], debug_log=str(blocker / "sub" / "log.jsonl"))
    before = errors()
    assert rs.score([GOOD], "B").totals == [1.0]
    assert errors() == before + 1
