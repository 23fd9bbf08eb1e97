"""bfloat16 log-probs on the tiny models (CPU): how far two bf16 computations of one policy drift apart, against
the tolerance the clipped importance ratio lives with (``BF16_LOGPROB_TOL``, ``BF16_LOGPROB_MEAN_TOL``).

bf16 rounds a logit x to about |x|·2^-9, so the error grows with the logits' spread: the random tiny model's
logits are nearly uniform (|x| < 1), where bf16 hides. Each check runs at that scale and again with the LM
head scaled so that the logits spread like a trained model's (standard deviation 3, extremes near ±12).
Compared, as the loss sees them: the learner's shared-vision path against the per-row one (both bf16 autocast
over fp32 master weights), and the HF engine's behaviour log-probs, sampled with bf16 weights (the default
``model.dtype``), against the learner's recompute of the same tokens in fp32 (the default ``learner.bf16:
false``), in bf16 autocast (``learner.bf16: true``), and with the weights stored in bf16 (``learner.bf16:
true`` keeps the weights that do not train so: a LoRA learner's whole base).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_logprobs import _load, _three_groups

from streamgrpo.config import LossConfig
from streamgrpo.models.batching import GroupInputs, build_batch, pad_right, vision_token_ids
from streamgrpo.models.logprobs import (
    BF16_LOGPROB_MEAN_TOL,
    BF16_LOGPROB_TOL,
    completion_logprobs,
    last_hidden_states,
    per_row_logprobs,
)
from tests.unit.engines.test_engine_hf import _request

SPREADS = [None, 3.0]  # the tiny model's own logits; a trained model's spread


def test_the_tolerance_fits_inside_the_clip_band():
    """A log-prob error d moves the ratio by e^d: at the tolerance, under half of each side of the default band."""
    eps = LossConfig()
    assert math.exp(BF16_LOGPROB_TOL) - 1 < eps.epsilon_high / 2
    assert 1 - math.exp(-BF16_LOGPROB_TOL) < eps.epsilon / 2
    assert math.exp(BF16_LOGPROB_MEAN_TOL) - 1 < 0.2 * eps.epsilon


def _policy(path, spread):
    """A float32 copy of the tiny model, its LM head scaled so that the logits of ``batch`` have std ``spread``."""
    proc, base = _load(path)
    model = copy.deepcopy(base)
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    if spread is not None:
        with torch.no_grad():
            std = float(model.lm_head(last_hidden_states(model, batch)).std())
            model.lm_head.weight.mul_(spread / std)
    return proc, model, batch


def _gaps(a, b, mask):
    d = (a - b)[mask].abs()
    return float(d.max()), float(d.mean())


def _within(name, gaps):
    worst, mean = gaps
    assert worst <= BF16_LOGPROB_TOL and mean <= BF16_LOGPROB_MEAN_TOL, f"{name}: max {worst:.4f}, mean {mean:.4f}"


@pytest.mark.parametrize("spread", SPREADS, ids=["tiny-logits", "trained-spread"])
def test_learner_bf16_paths_agree_within_the_tolerance(tiny_any_dir, spread):
    proc, model, batch = _policy(tiny_any_dir, spread)
    m = batch.completion_mask
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, batch, temperature=0.7)
        fp32_row, _ = per_row_logprobs(model, batch, temperature=0.7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            shared, _ = completion_logprobs(model, batch, temperature=0.7)
            per_row, _ = per_row_logprobs(model, batch, temperature=0.7)
    torch.testing.assert_close(fp32, fp32_row, atol=1e-5, rtol=0)  # fp32: the two paths are the same maths
    _within("bf16 shared vision vs bf16 per row", _gaps(shared, per_row, m))
    # bf16 really ran, and its error grows with the logits' spread (the scale a trained model has is what matters)
    vs_fp32 = _gaps(shared, fp32, m)
    assert vs_fp32[0] > (0.01 if spread else 1e-4), vs_fp32


@pytest.mark.parametrize("spread", SPREADS, ids=["tiny-logits", "trained-spread"])
def test_hf_engine_bf16_behaviour_vs_learner_bf16_recompute(tiny_model_dir, spread):
    """The generator samples with bf16 weights (model.dtype); the learner recomputes with bf16 autocast over
    its fp32 master copy of the same weights (learner.bf16): the ratio the loss sees on on-policy tokens."""
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.engines.hf import HFEngine

    proc, model, _ = _policy(tiny_model_dir, spread)
    engine = HFEngine(copy.deepcopy(model).to(torch.bfloat16), proc)
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue"),
            _request(proc, 4, (30, 30, 220), "Which colour?")]
    out = engine.generate(reqs, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=0))
    groups = [GroupInputs.from_processor(r.inputs, [torch.from_numpy(c.token_ids.astype(np.int64)) for c in g])
              for r, g in zip(reqs, out)]
    batch = build_batch(groups, proc.tokenizer.pad_token_id, model=model)
    behaviour = pad_right([torch.from_numpy(c.logprobs) for g in out for c in g], 0.0, dtype=torch.float32)
    m = batch.completion_mask
    assert int(m.sum()) > 40
    suppress = vision_token_ids(proc)
    with torch.no_grad():
        learner_fp32, _ = completion_logprobs(model, batch, suppress_token_ids=suppress)  # learner.bf16=false
        with torch.autocast("cpu", dtype=torch.bfloat16):  # learner.bf16=true (torch backend)
            learner_bf16, _ = completion_logprobs(model, batch, suppress_token_ids=suppress)
            # learner.bf16=true with LoRA: the base (all of the policy while B = 0) is stored in bf16
            stored, _ = completion_logprobs(copy.deepcopy(model).to(torch.bfloat16), batch, suppress_token_ids=suppress)
    eps = LossConfig()
    for name, learner in (("bf16 autocast", learner_bf16), ("fp32", learner_fp32), ("bf16-stored base", stored)):
        _within(f"HF engine (bf16 weights) vs learner ({name})", _gaps(learner, behaviour, m))
        ratio = torch.exp(learner - behaviour)[m]
        assert ((ratio > 1 - eps.epsilon) & (ratio < 1 + eps.epsilon_high)).all(), f"{name}: precision clipped a token"
    assert _gaps(learner_bf16, behaviour, m)[0] > (0.01 if spread else 1e-4)  # the sampler's bf16 is visible
    # a base stored in bf16 computes as the sampler does (bf16 residual stream): closer on average than autocast
    # over fp32 (the worst single token can go either way: 0.042 against 0.037 at std 3, transformers 5.24)
    assert _gaps(stored, behaviour, m)[1] < _gaps(learner_bf16, behaviour, m)[1]
