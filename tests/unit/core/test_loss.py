"""The clipped importance-ratio GRPO loss against hand-written references (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamgrpo import metrics
from streamgrpo.loss import LOSS_TYPES, LossError, LossSpec, kl_k3
from streamgrpo.loss import compute_loss as _compute_loss


def compute_loss(logprobs, behaviour_logprobs, advantages, mask, ref_logprobs=None, *, entropies=None,
                 token_normaliser=None, **spec):
    """The loss with its settings as keywords: this test's shorthand for ``spec=LossSpec(...)``."""
    return _compute_loss(logprobs, behaviour_logprobs, advantages, mask, ref_logprobs, entropies=entropies,
                         token_normaliser=token_normaliser, spec=LossSpec(**spec))


EPS, EPS_H = 0.2, 0.28
L_MAX = 6


# ------------------------------------------------------------------ hand-written references
def aggregate(per_token, mask, loss_type, max_len=L_MAX, normaliser=None):
    """Reference aggregation over nested Python lists (B rows of T values)."""
    B = len(per_token)
    rows = [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(per_token, mask)]
    n = sum(len(r) for r in rows)
    if loss_type == "grpo":
        return sum(sum(r) / max(len(r), 1) for r in rows) / B
    if loss_type == "bnpo":
        return sum(map(sum, rows)) / max(n, 1)
    if loss_type == "dr_grpo":
        return sum(map(sum, rows)) / (B * max_len)
    return sum(map(sum, rows)) / (normaliser if normaliser is not None else max(n, 1))


def token_weights(mask, loss_type, max_len=L_MAX, normaliser=None):
    """d loss / d per_token_loss[b][t] for each aggregation (the gradient reference)."""
    B = len(mask)
    n = sum(map(sum, mask))
    out = []
    for mrow in mask:
        nb = sum(mrow)
        if loss_type == "grpo":
            w = 1.0 / (max(nb, 1) * B)
        elif loss_type == "bnpo":
            w = 1.0 / max(n, 1)
        elif loss_type == "dr_grpo":
            w = 1.0 / (B * max_len)
        else:
            w = 1.0 / (normaliser if normaliser is not None else max(n, 1))
        out.append([w if m else 0.0 for m in mrow])
    return out


def reference_token(p, q, r, A, *, beta=0.0, tis=None, eps=EPS, eps_h=EPS_H):
    """(loss, d loss / d p) of one token, written out by hand."""
    ratio = math.exp(p - q)
    clipped = min(max(ratio, 1 - eps), 1 + eps_h)
    obj = min(ratio * A, clipped * A)
    clipped_side = (A > 0 and ratio > 1 + eps_h) or (A < 0 and ratio < 1 - eps)
    dobj = 0.0 if clipped_side else A * ratio
    w = min(ratio, tis) if tis is not None else 1.0
    loss, dloss = -obj * w, -dobj * w
    if beta > 0:
        d = r - p
        loss += beta * (math.exp(d) - d - 1)
        dloss += beta * (1 - math.exp(d))
    return loss, dloss


def make_batch(seed=0, B=4, T=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    behaviour = logp + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5) * 1.2  # ratios in ~[0.55, 1.8]
    ref = logp + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5) * 0.8
    adv = torch.tensor([1.5, -0.7, 0.3, -1.1], dtype=dtype)[:B]
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool
    )[:B, :T]
    return logp, behaviour, ref, adv, mask


# ------------------------------------------------------------------ each loss_type vs reference
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta, tis", [(0.0, None), (0.05, None), (0.0, 1.3), (0.1, 1.1)])
def test_loss_type_matches_hand_reference(loss_type, beta, tis):
    logp, behaviour, ref, adv, mask = make_batch()
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = compute_loss(
        leaf,
        behaviour,
        adv,
        mask,
        ref,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=L_MAX,
        tis_cap=tis,
    )
    loss.backward()
    toks = [
        [reference_token(p, q, r, A, beta=beta, tis=tis) for p, q, r in zip(pr, qr, rr)]
        for pr, qr, rr, A in zip(logp.tolist(), behaviour.tolist(), ref.tolist(), adv.tolist())
    ]
    m = mask.tolist()
    expected = aggregate([[t[0] for t in row] for row in toks], m, loss_type)
    w = token_weights(m, loss_type)
    expected_grad = torch.tensor(
        [[t[1] * wi for t, wi in zip(row, wrow)] for row, wrow in zip(toks, w)], dtype=torch.float64
    )
    assert loss.dtype == torch.float64 and loss.ndim == 0
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(leaf.grad, expected_grad.to(leaf.grad.dtype), rtol=1e-10, atol=1e-12)
    # the batch really exercises both clip sides
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0


def test_grpo_counts_empty_rows_in_the_mean():
    logp, behaviour, _, adv, mask = make_batch()
    full, _ = compute_loss(logp, behaviour, adv, mask, loss_type="grpo")
    three, _ = compute_loss(logp[:3], behaviour[:3], adv[:3], mask[:3], loss_type="grpo")
    assert full.item() == pytest.approx(three.item() * 3 / 4, rel=1e-12)


# ------------------------------------------------------------------ on-policy = plain policy gradient
def _pg_reference_grad(logp, adv, mask, loss_type, normaliser=None):
    leaf = logp.detach().clone().requires_grad_(True)
    per_token = -(adv[:, None] * leaf)
    m = mask.to(leaf.dtype)
    if loss_type == "grpo":
        ref = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        ref = (per_token * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        ref = (per_token * m).sum() / (logp.shape[0] * L_MAX)
    else:
        ref = (per_token * m).sum() / (normaliser or m.sum().clamp(min=1))
    ref.backward()
    return ref.detach(), leaf.grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_gradient_equals_policy_gradient(loss_type):
    logp, _, _, adv, mask = make_batch(seed=3)
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = compute_loss(
        leaf, leaf.detach(), adv, mask, loss_type=loss_type, max_completion_length=L_MAX
    )
    loss.backward()
    pg_loss, pg_grad = _pg_reference_grad(logp, adv, mask, loss_type)
    torch.testing.assert_close(leaf.grad, pg_grad, rtol=1e-12, atol=1e-14)
    # value: -A on every token (ratio 1), aggregated
    ones_loss = aggregate([[-a] * logp.shape[1] for a in adv.tolist()], mask.tolist(), loss_type)
    assert loss.item() == pytest.approx(ones_loss, rel=1e-12)
    assert metrics["clip_frac"] == 0 and metrics["ratio_max"] == 1 and metrics["ratio_min"] == 1


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ratio_mode_current_ignores_staleness(loss_type):
    logp, behaviour, _, adv, mask = make_batch(seed=4)
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = compute_loss(leaf, None, adv, mask, ratio_mode="current", loss_type=loss_type,
                                 max_completion_length=L_MAX)
    loss.backward()
    _, pg_grad = _pg_reference_grad(logp, adv, mask, loss_type)
    torch.testing.assert_close(leaf.grad, pg_grad, rtol=1e-12, atol=1e-14)
    assert metrics["clip_frac"] == 0
    # stale behaviour log-probs change nothing except the importance-ratio metrics
    loss2, metrics2 = compute_loss(
        logp, behaviour, adv, mask, ratio_mode="current", loss_type=loss_type, max_completion_length=L_MAX
    )
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    assert metrics2["clip_frac"] == 0 and metrics2["ratio_max"] > 1.1


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 7),
    st.integers(0, 2**31 - 1),
    st.sampled_from(LOSS_TYPES),
)
def test_property_on_policy_gradient(B, T, seed, loss_type):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_loss(leaf, logp, adv, mask, loss_type=loss_type, max_completion_length=L_MAX)
    loss.backward()
    _, pg_grad = _pg_reference_grad(logp, adv, mask, loss_type)
    torch.testing.assert_close(leaf.grad, pg_grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ clipping, by hand
# (advantage, ratio, expected per-token loss, expected d loss / d logp, clipped side)
CASES = [
    (1.0, 1.5, -(1 + EPS_H), 0.0, "high"),  # A>0 above 1+eps_high: clipped, no gradient
    (1.0, 1.1, -1.1, -1.1, None),  # inside the trust region
    (1.0, 0.5, -0.5, -0.5, None),  # A>0 below 1-eps: min picks the unclipped term, gradient flows
    (-1.0, 0.5, (1 - EPS), 0.0, "low"),  # A<0 below 1-eps: clipped, no gradient
    (-1.0, 0.9, 0.9, 0.9, None),  # inside
    (-1.0, 1.5, 1.5, 1.5, None),  # A<0 above 1+eps_high: unclipped (pessimistic), gradient flows
    (2.0, 0.7, -1.4, -1.4, None),  # A>0 at ratio<1-eps, scaled advantage
    (-2.0, 1.3, 2.6, 2.6, None),
]


@pytest.mark.parametrize("A, ratio, exp_loss, exp_grad, side", CASES)
def test_clipping_hand_cases(A, ratio, exp_loss, exp_grad, side):
    behaviour = torch.tensor([[-1.0]], dtype=torch.float64)
    leaf = (behaviour + math.log(ratio)).requires_grad_(True)
    loss, metrics = compute_loss(
        leaf, behaviour, torch.tensor([A], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    )
    loss.backward()
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    assert leaf.grad.item() == pytest.approx(exp_grad, rel=1e-12, abs=1e-15)
    assert metrics["clip_frac_low"].item() == (1.0 if side == "low" else 0.0)
    assert metrics["clip_frac_high"].item() == (1.0 if side == "high" else 0.0)
    assert metrics["clip_frac"].item() == (0.0 if side is None else 1.0)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio, rel=1e-12)


def test_asymmetric_bounds_are_respected():
    behaviour = torch.zeros(1, 1, dtype=torch.float64)
    for ratio, clipped in [(1.25, False), (1.35, True)]:
        leaf = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
        loss, m = compute_loss(
            leaf,
            behaviour,
            torch.ones(1, dtype=torch.float64),
            torch.ones(1, 1),
            epsilon=0.2,
            epsilon_high=0.3,
        )
        loss.backward()
        assert (leaf.grad.item() == 0.0) == clipped and bool(m["clip_frac_high"] > 0) == clipped


# ------------------------------------------------------------------ truncated importance sampling
@pytest.mark.parametrize(
    "ratio, mode, exp_loss, exp_grad",
    [
        (2.0, "behaviour", -2.0 * 1.5, -2.0 * 1.5),  # objective ratio*A times min(2, 1.5)
        (0.5, "behaviour", -0.5 * 0.5, -0.5 * 0.5),  # weight below the cap is the ratio itself
        (2.0, "current", -1.5, -1.5),  # truncated IS policy gradient: A * min(ratio, cap) * grad logp
        (0.5, "current", -0.5, -0.5),
    ],
)
def test_tis_cap(ratio, mode, exp_loss, exp_grad):
    behaviour = torch.tensor([[-2.0]], dtype=torch.float64)
    leaf = (behaviour + math.log(ratio)).requires_grad_(True)
    loss, _ = compute_loss(
        leaf,
        behaviour,
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, 1),
        epsilon=0.9,
        epsilon_high=5.0,
        tis_cap=1.5,
        ratio_mode=mode,
    )
    loss.backward()
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    assert leaf.grad.item() == pytest.approx(exp_grad, rel=1e-12)


@pytest.mark.parametrize(
    "ratio,adv,cap,exp_loss,exp_grad",
    [
        # one token, behaviour logp -2, current logp -2 + log(ratio), A = adv, dapo over one token:
        # J = A * w * rho with rho = exp(p - sg(p)) = 1 (grad: grad p), w = sg(exp(p - q)) = ratio
        (2.0, 1.0, None, -2.0, -2.0),  # no cap: the plain behaviour weight; far beyond the clip band
        (2.0, 1.0, 1.5, -1.5, -1.5),  # weight truncated at the cap
        (0.25, -1.0, None, 0.25, 0.25),  # A < 0 and a ratio far below 1 - epsilon: still a gradient
        (1.0, 1.0, None, -1.0, -1.0),  # on-policy: plain policy gradient
    ],
)
def test_decoupled_weights_by_behaviour_and_clips_around_the_learner(ratio, adv, cap, exp_loss, exp_grad):
    behaviour = torch.tensor([[-2.0]], dtype=torch.float64)
    leaf = (behaviour + math.log(ratio)).requires_grad_(True)
    loss, metrics = compute_loss(leaf, behaviour, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1),
                                 tis_cap=cap, ratio_mode="decoupled")
    loss.backward()
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    assert leaf.grad.item() == pytest.approx(exp_grad, rel=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio, rel=1e-12)  # the metric stays exp(p - q)
    assert metrics["clip_frac"] == 0  # the proximal ratio is 1 within the step


def test_decoupled_equals_current_with_the_cap_and_needs_behaviour():
    logp, behaviour, _, adv, mask = make_batch(seed=7)
    a, _ = compute_loss(logp, behaviour, adv, mask, ratio_mode="decoupled", tis_cap=1.05)
    b, _ = compute_loss(logp, behaviour, adv, mask, ratio_mode="current", tis_cap=1.05)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert (behaviour - logp)[mask.bool()].min() < -0.05  # some weights exceed the cap
    c, _ = compute_loss(logp, behaviour, adv, mask, ratio_mode="decoupled")
    assert c.item() != pytest.approx(b.item(), rel=1e-6)  # uncapped weights differ from the capped ones
    with pytest.raises(LossError, match="behaviour_logprobs is None but ratio_mode='decoupled'"):
        compute_loss(logp, None, adv, mask, ratio_mode="decoupled")


# ------------------------------------------------------------------ KL (k3) and beta = 0
class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"ref_logprobs was touched ({name})")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_beta_zero_never_touches_ref(loss_type):
    logp, behaviour, _, adv, mask = make_batch()
    base, mb = compute_loss(
        logp, behaviour, adv, mask, None, loss_type=loss_type, max_completion_length=L_MAX
    )
    loss, m = compute_loss(
        logp, behaviour, adv, mask, _Untouchable(), beta=0.0, loss_type=loss_type, max_completion_length=L_MAX
    )
    assert torch.equal(loss, base) and m["kl"] == 0 and mb["kl"] == 0
    nan_ref = torch.full_like(logp, float("nan"))
    loss, _ = compute_loss(
        logp, behaviour, adv, mask, nan_ref, beta=0.0, loss_type=loss_type, max_completion_length=L_MAX
    )
    assert torch.equal(loss, base)


def test_k3_nonnegative_and_zero_when_equal():
    p = torch.linspace(-8, 0, 41, dtype=torch.float64)
    assert torch.equal(kl_k3(p, p), torch.zeros_like(p))
    r = p.flip(0)
    assert bool((kl_k3(p, r) >= 0).all()) and bool((kl_k3(p, r) > 0).any())
    # k3 of a known gap: exp(d) - d - 1
    assert kl_k3(torch.tensor(0.0), torch.tensor(0.5)).item() == pytest.approx(math.exp(0.5) - 1.5)


@settings(max_examples=80, deadline=None)
@given(
    st.floats(-30, 0, allow_nan=False),
    st.floats(-30, 0, allow_nan=False),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_property_k3_nonnegative(p, r, dtype):
    k = kl_k3(torch.tensor(p, dtype=dtype), torch.tensor(r, dtype=dtype))
    k_same = kl_k3(torch.tensor(p, dtype=dtype), torch.tensor(p, dtype=dtype))
    assert k.item() >= 0.0 and k_same.item() == 0.0
    d = r - p
    assert k.item() == pytest.approx(
        math.expm1(d) - d, rel=1e-5 if dtype == torch.float32 else 1e-12, abs=1e-6
    )


def test_kl_metric_and_equal_ref():
    logp, behaviour, _, adv, mask = make_batch()
    base, _ = compute_loss(logp, behaviour, adv, mask)
    same, m = compute_loss(logp, behaviour, adv, mask, logp.clone(), beta=0.5)
    assert same.item() == pytest.approx(base.item(), rel=1e-12) and m["kl"] == 0
    _, m = compute_loss(logp, behaviour, adv, mask, logp + 0.3, beta=0.5)
    assert m["kl"].item() == pytest.approx(math.exp(0.3) - 1.3, rel=1e-9)


# ------------------------------------------------------------------ zero advantages, masks, garbage
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_advantages_give_zero_gradient(loss_type):
    logp, behaviour, _, adv, mask = make_batch()
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_loss(
        leaf,
        behaviour,
        torch.zeros_like(adv),
        mask,
        loss_type=loss_type,
        max_completion_length=L_MAX,
        tis_cap=2.0,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_garbage_changes_nothing(loss_type):
    logp, behaviour, ref, adv, mask = make_batch()
    ent = torch.rand_like(logp)
    kw = dict(beta=0.1, loss_type=loss_type, max_completion_length=L_MAX, tis_cap=1.4)

    clean = logp.clone().requires_grad_(True)
    loss_c, m_c = compute_loss(clean, behaviour, adv, mask, ref, entropies=ent, **kw)
    loss_c.backward()

    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
    fill = junk.repeat(logp.numel() // 5 + 1)[: logp.numel()].view_as(logp)

    def dirty(x, f):
        return torch.where(mask, x, f)

    garbage = dirty(logp, fill).requires_grad_(True)
    adv_g = adv.clone()
    adv_g[3] = float("nan")  # the fully padded row
    loss_g, m_g = compute_loss(
        garbage,
        dirty(behaviour, fill.flip(0)),
        adv_g,
        mask,
        dirty(ref, fill.flip(1)),
        entropies=dirty(ent, fill),
        **kw,
    )
    loss_g.backward()
    assert torch.isfinite(loss_g) and loss_g.item() == pytest.approx(loss_c.item(), rel=1e-12)
    assert bool(torch.isfinite(garbage.grad).all())
    torch.testing.assert_close(garbage.grad, clean.grad, rtol=1e-12, atol=0)
    assert torch.equal(garbage.grad[~mask], torch.zeros(int((~mask).sum()), dtype=garbage.dtype))
    for k in m_c:
        torch.testing.assert_close(m_g[k], m_c[k], rtol=1e-12, atol=1e-12, msg=k)

    # extra padding columns change nothing either
    pad = lambda x, v=0.0: torch.cat([x, torch.full((x.shape[0], 3), v, dtype=x.dtype)], dim=1)  # noqa: E731
    loss_p, _ = compute_loss(
        pad(logp, float("nan")), pad(behaviour), adv, pad(mask, False), pad(ref), entropies=pad(ent), **kw
    )
    assert loss_p.item() == pytest.approx(loss_c.item(), rel=1e-12)


def test_float_mask_and_bf16_inputs():
    logp, behaviour, _, adv, mask = make_batch(dtype=torch.float32)
    loss, m = compute_loss(logp.bfloat16(), behaviour.bfloat16(), adv, mask.float())
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert m["num_tokens"].item() == mask.sum().item()


def test_empty_mask():
    logp, behaviour, _, adv, _ = make_batch()
    leaf = logp.clone().requires_grad_(True)
    for lt in LOSS_TYPES:
        loss, m = compute_loss(
            leaf,
            behaviour,
            adv,
            torch.zeros_like(leaf, dtype=torch.bool),
            loss_type=lt,
            max_completion_length=4,
        )
        loss.backward()
        assert loss.item() == 0.0 and m["num_tokens"] == 0 and m["ratio_mean"] == 1 and m["clip_frac"] == 0
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))


# ------------------------------------------------------------------ dapo normaliser (accumulation / ranks)
def test_dapo_global_normaliser_matches_whole_batch():
    logp, behaviour, ref, adv, mask = make_batch()
    whole = logp.clone().requires_grad_(True)
    loss_w, _ = compute_loss(whole, behaviour, adv, mask, ref, beta=0.05, loss_type="dapo", tis_cap=1.3)
    loss_w.backward()
    bnpo, _ = compute_loss(logp, behaviour, adv, mask, ref, beta=0.05, loss_type="bnpo", tis_cap=1.3)
    assert loss_w.item() == pytest.approx(bnpo.item(), rel=1e-12)  # one call: dapo == bnpo

    split = logp.clone().requires_grad_(True)
    n_global = int(mask.sum())
    total = 0.0
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):  # micro-batches (or ranks) of uneven size
        part, _ = compute_loss(
            split[rows],
            behaviour[rows],
            adv[rows],
            mask[rows],
            ref[rows],
            beta=0.05,
            loss_type="dapo",
            tis_cap=1.3,
            token_normaliser=n_global,
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss_w.item(), rel=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-15)
    # a tensor normaliser works the same
    t, _ = compute_loss(logp, behaviour, adv, mask, token_normaliser=torch.tensor(2 * n_global))
    d, _ = compute_loss(logp, behaviour, adv, mask)
    assert t.item() == pytest.approx(d.item() / 2, rel=1e-12)


# ------------------------------------------------------------------ metrics
def test_metrics_hand_computed():
    # rows: (A, ratio) = (+1, 1.5) high-clipped, (-1, 0.5) low-clipped, (+1, 0.5), (-1, 1.5); column 1 is padding
    A = torch.tensor([1.0, -1.0, 1.0, -1.0])
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5])
    behaviour = torch.full((4, 2), -1.0)
    logp = behaviour.clone()
    logp[:, 0] += ratio.log()
    logp[:, 1] = 100.0  # garbage ratio at padding
    mask = torch.tensor([[1, 0]] * 4, dtype=torch.bool)
    ent = torch.tensor([[1.0, 9.0], [2.0, 9.0], [3.0, 9.0], [4.0, 9.0]])
    leaf = logp.requires_grad_(True)
    loss, m = compute_loss(leaf, behaviour, A, mask, entropies=ent)
    expected_keys = {
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac",
        "ratio_mean",
        "ratio_max",
        "ratio_min",
        "kl",
        "adv_mean",
        "adv_std",
        "entropy",
        "num_tokens",
        "ratio_sq_mean",
        "kl_behaviour",
        "is_masked_frac",
    }
    assert set(m) == expected_keys
    for k, v in m.items():
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad, k
    approx = lambda k, v: m[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7)  # noqa: E731
    assert approx("clip_frac_low", 0.25) and approx("clip_frac_high", 0.25) and approx("clip_frac", 0.5)
    assert approx("ratio_mean", 1.0) and approx("ratio_max", 1.5) and approx("ratio_min", 0.5)
    assert approx("adv_mean", 0.0) and approx("adv_std", 1.0) and approx("entropy", 2.5)
    assert approx("num_tokens", 4) and approx("kl", 0.0)
    # weights 1.5, 0.5, 0.5, 1.5: mean w^2 = 1.25 (ESS fraction 1 / 1.25 = 0.8); k3 of KL(behaviour || current)
    assert approx("ratio_sq_mean", 1.25) and approx("is_masked_frac", 0.0)
    k3 = lambda w: (w - 1) - math.log(w)  # noqa: E731
    assert approx("kl_behaviour", (2 * k3(1.5) + 2 * k3(0.5)) / 4)
    # loss = -mean(min terms) = -(1.28 - 0.8 + 0.5 - 1.5) / 4
    assert loss.item() == pytest.approx(-(1.28 - 0.8 + 0.5 - 1.5) / 4, rel=1e-6)
    _, m2 = compute_loss(logp.detach(), behaviour, A, mask)
    assert "entropy" not in m2


# ------------------------------------------------------------------ masked importance sampling
def test_token_mis_drops_the_objective_of_tokens_outside_the_band():
    A = torch.tensor([1.0, -1.0, 1.0, -1.0])
    ratio = torch.tensor([1.5, 0.5, 0.9, 1.1])
    behaviour = torch.full((4, 1), -1.0)
    logp = (behaviour + ratio.log()[:, None]).requires_grad_(True)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, m = compute_loss(logp, behaviour, A, mask, is_mask="token", is_mask_band=(0.6, 1.4))
    assert loss.item() == pytest.approx(-(0.9 - 1.1) / 4, rel=1e-6)  # the normaliser still counts all 4 tokens
    assert m["is_masked_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[:2].abs().max().item() == 0.0 and logp.grad[2:].abs().min().item() > 0


def test_sequence_mis_judges_a_row_by_its_geometric_mean_ratio():
    behaviour = torch.full((2, 2), -1.0)
    ratios = torch.tensor([[2.0, 0.5], [1.5, 1.5]])  # row 0: geometric mean 1 (kept); row 1: 1.5 (masked)
    logp = behaviour + ratios.log()
    A, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool)
    _, seq = compute_loss(logp, behaviour, A, mask, is_mask="sequence", is_mask_band=(0.6, 1.4))
    _, tok = compute_loss(logp, behaviour, A, mask, is_mask="token", is_mask_band=(0.6, 1.4))
    assert seq["is_masked_frac"].item() == pytest.approx(0.5) and tok["is_masked_frac"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="is_mask_band"):
        compute_loss(logp, behaviour, A, mask, is_mask="token", is_mask_band=(1.2, 2.0))
    with pytest.raises(ValueError, match="is_mask="):
        compute_loss(logp, behaviour, A, mask, is_mask="row")


# ------------------------------------------------------------------ wrappers and errors
def test_the_spec_is_made_from_the_loss_section():
    from streamgrpo.config import LossConfig

    logp, behaviour, ref, adv, mask = make_batch()
    cfg = LossConfig(beta=0.04, loss_type="dr_grpo", tis_cap=2.0, is_mask_low=0.3)
    spec = LossSpec.from_config(cfg, max_completion_length=L_MAX)
    assert (spec.beta, spec.loss_type, spec.tis_cap, spec.max_completion_length) == (0.04, "dr_grpo", 2.0, L_MAX)
    assert spec.is_mask == cfg.is_mask and spec.is_mask_band == (0.3, cfg.is_mask_high)
    b, mb = _compute_loss(logp, behaviour, adv, mask, ref, spec=spec)
    assert torch.isfinite(b) and mb["kl"] > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(ratio_mode="old"), "ratio_mode"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(beta=0.1), "ref_logprobs"),
        (dict(loss_type="bnpo", token_normaliser=10), "token_normaliser"),
        (dict(advantages=torch.zeros(4, 1)), "advantages"),
        (dict(mask=torch.ones(4, 4)), "mask"),
        (dict(behaviour_logprobs=None), "behaviour_logprobs"),
        (dict(behaviour_logprobs=None, ratio_mode="current", tis_cap=2.0), "behaviour_logprobs"),
        (dict(entropies=torch.zeros(5)), "entropies"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    logp, behaviour, _, adv, mask = make_batch()
    args = dict(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, mask=mask)
    for k in list(kwargs):
        if k in args:
            args[k] = kwargs.pop(k)
    errors = metrics.ERRORS.labels(kind="loss")
    before = errors._value.get()
    with pytest.raises(LossError, match=match) as info:
        compute_loss(**args, **kwargs)
    assert isinstance(info.value, ValueError) and info.value.kind == "loss"
    assert errors._value.get() == before  # pure: the caller (the learner) counts it


def test_entropy_bonus_is_subtracted_per_token_and_carries_the_gradient():
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    ent = torch.tensor([[0.5, 1.0, 0.25], [2.0, 0.0, 99.0]], requires_grad=True)  # 99: masked, never read
    base, _ = compute_loss(logprobs, logprobs, adv, mask, entropies=ent.detach(), loss_type="dapo")
    loss, m = compute_loss(logprobs, logprobs, adv, mask, entropies=ent, loss_type="dapo", entropy_coef=0.1)
    # dapo: the token mean of (objective - 0.1 x entropy) over the 5 unmasked tokens
    assert float(loss - base) == pytest.approx(-0.1 * (0.5 + 1.0 + 0.25 + 2.0 + 0.0) / 5)
    loss.backward()
    assert torch.allclose(ent.grad, torch.tensor([[-0.02, -0.02, -0.02], [-0.02, -0.02, 0.0]]))
    assert float(m["entropy"]) == pytest.approx(3.75 / 5)
    g, _ = compute_loss(logprobs, logprobs, adv, mask, entropies=ent.detach(), loss_type="grpo", entropy_coef=0.1)
    gb, _ = compute_loss(logprobs, logprobs, adv, mask, entropies=ent.detach(), loss_type="grpo")
    assert float(g - gb) == pytest.approx(-0.1 * ((1.75 / 3) + (2.0 / 2)) / 2)  # grpo: per row, then rows
    with pytest.raises(LossError, match="entropy_coef=0.1 > 0 needs entropies"):
        compute_loss(logprobs, logprobs, adv, mask, entropy_coef=0.1)
    with pytest.raises(LossError, match="entropy_coef"):
        compute_loss(logprobs, logprobs, adv, mask, entropies=ent, entropy_coef=-1.0)


@pytest.mark.parametrize("ratio_mode,tis_cap,is_mask", [("behaviour", None, None), ("behaviour", None, "token"),
                                                         ("decoupled", 2.0, None), ("behaviour", 2.0, "sequence")])
def test_any_behaviour_log_prob_in_the_wire_range_keeps_loss_and_gradient_finite(ratio_mode, tis_cap, is_mask):
    """Behaviour log-probs at the ends of the wire's range [-1000, 0] with either sign of advantage: the log
    ratio is clamped at +-20 before exp, so nothing overflows (exp(95) is inf in float32)."""
    from streamgrpo.loss import LOG_RATIO_CLAMP

    logp = torch.tensor([[-5.0, -0.5, -2.0], [-3.0, -1.0, -4.0]], requires_grad=True)
    behaviour = torch.tensor([[-100.0, -1000.0, 0.0], [-0.0, -2.0, -1000.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    for adv in (torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])):
        loss, m = compute_loss(logp, behaviour, adv, mask, None, epsilon=EPS, epsilon_high=EPS_H, ratio_mode=ratio_mode,
                               tis_cap=tis_cap, is_mask=is_mask)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert math.isfinite(float(m["ratio_max"])) and float(m["ratio_max"]) == pytest.approx(math.exp(LOG_RATIO_CLAMP))
        assert math.isfinite(float(m["kl_behaviour"])) and math.isfinite(float(m["ratio_sq_mean"]))
