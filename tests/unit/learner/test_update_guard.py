"""The update-KL line search (learner.max_update_kl): pure logic."""

from __future__ import annotations

import math

import pytest
import torch

from streamgrpo.learner.update_guard import backtrack, kl_terms, shrink_towards


def test_kl_terms_is_k3_over_masked_tokens_only():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    new = torch.tensor([[-1.5, -2.0, 9.0], [-0.1, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the 9.0 sits under padding
    total, n = kl_terms(old, new, mask)
    d = torch.tensor([-0.5, 0.0, 0.0, 2.0])
    assert n == 4
    assert total == pytest.approx(float((torch.exp(d) - d - 1).sum()))
    assert kl_terms(old, old, mask) == (0.0, 4)
    with pytest.raises(ValueError, match="shapes differ"):
        kl_terms(old, new[:, :2], mask)


class _Step:
    """A step of size `scale` whose update_kl grows like scale^2 (as a KL does for small steps)."""

    def __init__(self, kl_full):
        self.kl_full, self.scale, self.calls = kl_full, 1.0, []

    def measure(self):
        return self.kl_full * self.scale ** 2

    def shrink(self, f):
        self.calls.append(f)
        self.scale *= f


def test_a_small_step_is_kept_whole():
    s = _Step(0.01)
    check = backtrack(s.measure, s.shrink, max_kl=0.1, max_halvings=4)
    assert (check.scale, check.halvings, check.undone, s.calls) == (1.0, 0, False, [])
    assert check.kl == check.kl_first == pytest.approx(0.01)


def test_a_large_step_is_halved_until_within_the_bound():
    s = _Step(1.0)  # halves: 0.25, 0.0625 <= 0.1
    check = backtrack(s.measure, s.shrink, max_kl=0.1, max_halvings=4)
    assert s.calls == [0.5, 0.5]
    assert (check.scale, check.halvings, check.undone) == (0.25, 2, False)
    assert check.kl_first == pytest.approx(1.0) and check.kl == pytest.approx(0.0625)


def test_a_step_still_too_large_after_the_last_halving_is_undone():
    s = _Step(1000.0)
    check = backtrack(s.measure, s.shrink, max_kl=0.1, max_halvings=3)
    assert s.calls == [0.5, 0.5, 0.5, 0.0] and s.scale == 0.0
    assert (check.scale, check.kl, check.halvings, check.undone) == (0.0, 0.0, 3, True)
    s0 = _Step(5.0)  # no halvings allowed: too large means undone at once
    assert backtrack(s0.measure, s0.shrink, max_kl=0.1, max_halvings=0).undone and s0.calls == [0.0]


def test_a_nan_measurement_counts_as_too_large():
    calls = []
    check = backtrack(lambda: math.nan, calls.append, max_kl=0.1, max_halvings=2)
    assert check.undone and calls == [0.5, 0.5, 0.0]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        backtrack(lambda: 0.0, lambda f: None, max_kl=0.0, max_halvings=1)
    with pytest.raises(ValueError):
        backtrack(lambda: 0.0, lambda f: None, max_kl=0.1, max_halvings=-1)


def test_shrink_towards_moves_along_the_step():
    before = [torch.zeros(3), torch.ones(2)]
    params = [torch.tensor([4.0, -8.0, 2.0]), torch.tensor([3.0, 1.0])]
    shrink_towards(params, before, 0.5)
    assert params[0].tolist() == [2.0, -4.0, 1.0] and params[1].tolist() == [2.0, 1.0]
    shrink_towards(params, before, 0.0)
    assert params[0].tolist() == [0.0, 0.0, 0.0] and params[1].tolist() == [1.0, 1.0]
