"""T-GRPO's temporal bonus (streamgrpo.rewards.temporal): p, p_shuffled, mu, alpha, correct_at."""

from __future__ import annotations

import pytest

from streamgrpo.rewards.combine import ScoredRewards
from streamgrpo.rewards.temporal import temporal_bonus, with_bonus


def test_bonus_goes_to_correct_ordered_answers_when_order_helped():
    out = temporal_bonus([1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], alpha=0.3, mu=0.8, correct_at=0.5)
    assert (out.p, out.p_shuffled, out.applied) == (0.75, 0.25, True)
    assert out.bonus_G == [0.3, 0.0, 0.3, 0.3]


def test_no_bonus_when_shuffled_frames_do_as_well():
    out = temporal_bonus([1.0, 0.0], [1.0, 1.0, 0.0, 1.0], alpha=0.3, mu=0.8, correct_at=0.5)
    assert (out.p, out.p_shuffled, out.applied) == (0.5, 0.75, False) and out.bonus_G == [0.0, 0.0]
    edge = temporal_bonus([1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0], alpha=0.3, mu=1.0, correct_at=0.5)
    assert not edge.applied  # p == mu * p_shuffled is not "beats"
    mu_scaled = temporal_bonus([1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0], alpha=0.3, mu=0.8, correct_at=0.5)
    assert mu_scaled.applied and mu_scaled.bonus_G == [0.3, 0.3, 0.3, 0.0, 0.0]


def test_all_wrong_gets_nothing_and_all_wrong_shuffled_is_beaten_by_any_right_answer():
    assert temporal_bonus([0.0, 0.0], [0.0], alpha=0.3, mu=0.8, correct_at=0.5).bonus_G == [0.0, 0.0]
    out = temporal_bonus([0.0, 1.0], [0.0, 0.0], alpha=0.5, mu=0.8, correct_at=0.5)
    assert out.applied and out.bonus_G == [0.0, 0.5]


def test_correct_at_is_the_threshold_of_the_reward_value():
    out = temporal_bonus([0.4, 0.6, 0.9], [0.1, 0.2], alpha=0.3, mu=0.8, correct_at=0.6)
    assert out.p == pytest.approx(2 / 3) and out.bonus_G == [0.0, 0.3, 0.3]
    with pytest.raises(ValueError, match="both groups"):
        temporal_bonus([1.0], [], alpha=0.3, mu=0.8, correct_at=0.5)


def test_with_bonus_adds_its_own_reward_function_to_totals():
    scored = ScoredRewards(totals=[1.0, 0.2], per_fn={"accuracy": [1.0, 0.0], "format": [1.0, 1.0]})
    bonus = temporal_bonus([1.0, 0.0], [0.0, 0.0], alpha=0.3, mu=0.8, correct_at=0.5)
    out = with_bonus(scored, bonus)
    assert out.totals == pytest.approx([1.3, 0.2]) and out.per_fn["temporal"] == [0.3, 0.0]
    assert out.for_completion(0) == {"accuracy": 1.0, "format": 1.0, "temporal": 0.3}
    assert scored.per_fn.keys() == {"accuracy", "format"}  # the input is not changed
