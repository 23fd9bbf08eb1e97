"""The live agreement guard (pure) and which tokens it measures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from streamgrpo.config import build_config
from streamgrpo.learner.agreement_guard import AgreementGuard
from streamgrpo.learner.micro_batches import fresh_token_mask


def test_the_guard_warns_once_past_the_threshold_over_its_window_and_rearms():
    g = AgreementGuard.from_config(build_config({}, ["learner.agreement_max_kl=0.01", "learner.agreement_window=3"]).learner)
    assert g.mean() is None and g.observe(0.0, 0) is None  # no staleness-0 token yet: nothing to judge
    assert g.observe(0.001 * 100, 100) is None and math.isclose(g.mean(), 0.001)
    line = g.observe(0.5 * 100, 100)  # the window's mean jumps to 0.2505
    assert line is not None and line.startswith("generators and learner disagree: KL 0.2505 > 0.01")
    assert "streamgrpo check agreement" in line and "200 tokens" in line
    assert g.observe(0.5 * 100, 100) is None  # once, while it stays past the threshold
    for _ in range(3):
        g.observe(0.0, 100)  # three good steps push the bad ones out of the window
    assert g.mean() == 0.0 and not g.firing
    assert g.observe(1.0 * 10, 10) is not None  # and it warns again on a new mismatch
    assert g.observe(0.0, 0) is None and len(g.steps) == 3  # a step without fresh tokens changes nothing


def _accepted(staleness, policy_version, versions_per_completion, lengths):
    comps = [SimpleNamespace(token_ids=np.zeros(n, np.int64), versions=None if v is None else np.asarray(v, np.int32))
             for v, n in zip(versions_per_completion, lengths)]
    return SimpleNamespace(staleness=staleness, group=SimpleNamespace(policy_version=policy_version, completions=comps))


def test_fresh_tokens_are_those_sampled_with_the_learners_current_version():
    # learner at v7: a group at v5 whose second completion's last tokens came from v7 (in-flight update),
    # a group at v7 without token versions (all fresh), a stale one without versions (none)
    part = [_accepted(2, 5, [[5, 5, 5], [5, 7, 7]], [3, 3]), _accepted(0, 7, [None], [2]), _accepted(1, 6, [None], [4])]
    m = fresh_token_mask(part, 5).numpy()
    assert m.shape == (4, 5)
    assert m.tolist() == [[False] * 5, [False, True, True, False, False], [True, True, False, False, False],
                          [False] * 5]
