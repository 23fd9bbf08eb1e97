"""The live agreement guard (pure) and which tokens it measures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from streamgrpo.config import build_config
from streamgrpo.learner.agreement_guard import AgreementGuard
from streamgrpo.learner.micro_batches import fresh_token_mask, token_staleness


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


def test_token_staleness_counts_from_each_tokens_own_version():
    # the same part: per-token versions where the message has them, else the group's staleness
    part = [_accepted(2, 5, [[5, 5, 5], [5, 7, 7]], [3, 3]), _accepted(0, 7, [None], [2]), _accepted(1, 6, [None], [4])]
    s = token_staleness(part, 5).numpy()
    assert s.tolist() == [[2, 2, 2, 0, 0], [2, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert ((s == 0) & (np.arange(5) < np.array([[3], [3], [2], [4]]))).tolist() == fresh_token_mask(part, 5).numpy().tolist()


def test_staleness_sums_bucket_the_masked_tokens():
    import torch

    from streamgrpo.learner.trainer import staleness_sums

    d = torch.tensor([[0.0, 1.0, -1.0, 9.0], [0.5, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    stale = torch.tensor([[0, 1, 1, 1], [5, 3, 0, 0]])
    b = staleness_sums(d, mask, stale)
    assert [x.tokens for x in b] == [1, 2, 0, 2]  # the masked 9.0 counts nowhere; 5 and 3 share "3+"
    assert math.isclose(b[1].log_ratio_sum, 0.0) and math.isclose(b[1].kl_sum, (math.e - 2) + (math.exp(-1) - 1 + 1), rel_tol=1e-6)
    assert math.isclose(b[3].log_ratio, 0.5) and math.isclose(b[3].kl, math.exp(0.5) - 1.5, rel_tol=1e-6)
