"""Group-relative advantages: hand-computed values, zero-variance groups, ragged batches, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamgrpo.advantages import AdvantageError, batch_advantages, group_advantages

EPS = 1e-4


def test_group_scaling_hand_computed():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "group", eps=EPS)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + EPS)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_none_scaling_is_centring_only():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), "none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_single_group_batch_scaling_equals_group_scaling():
    r = torch.tensor([0.2, 0.9, 0.4, 0.4, 1.0])
    torch.testing.assert_close(group_advantages(r, "batch"), group_advantages(r, "group"))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gives_exact_zeros(scale):
    # 0.1 * 3 / 3 != 0.1 in floating point: the zeros must be exact anyway.
    r = torch.full((3,), 0.1, dtype=torch.float64)
    adv = group_advantages(r, scale)
    assert adv.dtype == torch.float64
    assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))
    advs, zero_var = batch_advantages(torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.5]]), scale)
    assert torch.equal(advs[0], torch.zeros(3))
    assert zero_var.tolist() == [True, False]
    assert bool((advs[1] != 0).any())


def test_integer_rewards_give_float32():
    adv = group_advantages(torch.tensor([0, 1, 1, 0]), "group")
    assert adv.dtype == torch.float32
    assert adv[1] > 0 > adv[0]


def test_matrix_group_and_none_equal_per_row():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 3.0, 1.0]])
    for scale in ("group", "none"):
        adv, zv = batch_advantages(r, scale, eps=EPS)
        assert adv.shape == r.shape
        for i in range(3):
            torch.testing.assert_close(adv[i], group_advantages(r[i], scale, eps=EPS))
        assert zv.tolist() == [False, True, False]


def test_matrix_batch_scaling_uses_whole_batch_std():
    r = torch.tensor([[1.0, 0.0], [5.0, 3.0]])
    adv, zv = batch_advantages(r, "batch", eps=EPS)
    batch_std = torch.tensor([1.0, 0.0, 5.0, 3.0], dtype=torch.float64).std().item()  # raw rewards, unbiased
    expected = torch.tensor([[0.5, -0.5], [1.0, -1.0]]) / (batch_std + EPS)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert zv.tolist() == [False, False]


def test_ragged_groups():
    groups = [
        torch.tensor([1.0, 0.0, 0.0]),
        torch.tensor([0.7]),
        torch.tensor([]),
        torch.tensor([2.0, 4.0, 4.0, 2.0]),
    ]
    adv, zv = batch_advantages(groups, "group", eps=EPS)
    assert isinstance(adv, list) and [a.shape[0] for a in adv] == [3, 1, 0, 4]
    assert zv.tolist() == [False, True, True, False]
    assert torch.equal(adv[1], torch.zeros(1))
    torch.testing.assert_close(adv[0], group_advantages(groups[0], "group", eps=EPS))
    torch.testing.assert_close(adv[3], group_advantages(groups[3], "group", eps=EPS))

    adv_b, _ = batch_advantages(groups, "batch", eps=EPS)
    std = torch.cat(groups).double().std().item()
    torch.testing.assert_close(adv_b[0], (groups[0] - 1 / 3) / (std + EPS))
    torch.testing.assert_close(adv_b[3], (groups[3] - 3.0) / (std + EPS))
    assert torch.equal(adv_b[1], torch.zeros(1))


def test_zero_variance_weight_measures_flat_groups_against_the_batch():
    # an all-wrong group, an all-right group and a mixed one; batch mean 4/12, batch std unbiased
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    mean, std = 6 / 12, r.double().std(correction=1).item()
    advs, zero_var = batch_advantages(r, "group", eps=EPS, zero_variance_weight=0.5)
    torch.testing.assert_close(advs[0], torch.full((4,), 0.5 * (0 - mean) / (std + EPS)))
    torch.testing.assert_close(advs[1], torch.full((4,), 0.5 * (1 - mean) / (std + EPS)))
    assert bool((advs[0] < 0).all()) and bool((advs[1] > 0).all())  # all wrong: pushed down; all right: up
    plain, _ = batch_advantages(r, "group", eps=EPS)
    torch.testing.assert_close(advs[2], plain[2])  # a mixed group keeps its group-relative advantages
    assert torch.equal(plain[0], torch.zeros(4))  # weight 0: GRPO's exact zeros
    assert zero_var.tolist() == [True, True, False]  # still flagged: its rewards are all equal
    none, _ = batch_advantages(r, "none", zero_variance_weight=1.0)
    torch.testing.assert_close(none[0], torch.full((4,), -mean))  # no std division with scale "none"


def test_zero_variance_weight_on_a_flat_batch_gives_exact_zeros():
    advs, zero_var = batch_advantages([torch.ones(3), torch.ones(2)], "batch", zero_variance_weight=1.0)
    assert all(torch.equal(a, torch.zeros_like(a)) for a in advs) and zero_var.tolist() == [True, True]


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan")])
def test_zero_variance_weight_out_of_range_is_a_clear_error(weight):
    with pytest.raises(AdvantageError, match="zero_variance_weight"):
        batch_advantages(torch.zeros(2, 2), zero_variance_weight=weight)


def test_empty_batch():
    adv, zv = batch_advantages([], "batch")
    assert adv == [] and zv.shape == (0,)


@pytest.mark.parametrize(
    "call, match, kind",
    [
        (lambda: group_advantages(torch.tensor([1.0, float("nan")])), "finite", "reward"),
        (lambda: group_advantages(torch.zeros(2, 2)), "1-D", "loss"),
        (lambda: group_advantages(torch.zeros(2), "std"), "scale_rewards", "loss"),
        (lambda: batch_advantages(torch.zeros(4)), r"\(N, G\)", "loss"),
        (lambda: batch_advantages([torch.zeros(2), torch.tensor([float("inf")])]), "group 1", "reward"),
    ],
)
def test_bad_input_is_a_clear_error(call, match, kind):
    from streamgrpo.metrics import ERRORS

    before = {k: ERRORS.labels(kind=k)._value.get() for k in ("loss", "reward")}
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert isinstance(info.value, AdvantageError) and info.value.kind == kind  # what the caller counts
    assert {k: ERRORS.labels(kind=k)._value.get() for k in ("loss", "reward")} == before  # pure: counts nothing


_reward = st.floats(-10.0, 10.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(_reward, min_size=1, max_size=16), st.floats(-5.0, 5.0, width=32))
def test_property_group_mode(rewards, shift):
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = group_advantages(r, "group", eps=EPS)
    all_equal = bool(r.max() == r.min())
    assert bool((adv == 0).all()) == all_equal
    if all_equal:
        assert torch.equal(adv, torch.zeros_like(r))
        return
    std = r.std().item()
    assert abs(adv.sum().item()) < 1e-9 * len(rewards) * (1 + 1 / std)
    torch.testing.assert_close(adv.std(), torch.tensor(std / (std + EPS), dtype=torch.float64))
    # order preserved, shift invariant
    # (weakly: values closer than rounding may become ties)
    less = r[:, None] < r[None, :]
    assert bool((adv[:, None] <= adv[None, :])[less].all())
    shifted = r + shift
    if bool(shifted.max() != shifted.min()):
        torch.testing.assert_close(group_advantages(shifted, "group", eps=EPS), adv, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(_reward, min_size=1, max_size=6), min_size=1, max_size=5))
def test_property_batch_agrees_with_group(groups):
    tensors = [torch.tensor(g, dtype=torch.float64) for g in groups]
    adv, zv = batch_advantages(tensors, "group", eps=EPS)
    for g, a, z in zip(tensors, adv, zv.tolist()):
        assert z == bool(g.max() == g.min())
        assert torch.equal(a, group_advantages(g, "group", eps=EPS))
    adv_n, _ = batch_advantages(tensors, "none")
    for g, a, z in zip(tensors, adv_n, zv.tolist()):
        expected = torch.zeros_like(g) if z else g - g.mean()
        torch.testing.assert_close(a, expected)
