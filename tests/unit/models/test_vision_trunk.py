"""A frozen vision trunk runs once per batch, without gradients, shared by the policy and its reference
(streamgrpo/models/vision_trunk.py): the same log-probs and gradients as running the whole tower in every
forward, on the tiny Qwen2.5-VL and Qwen3-VL (deepstack mergers)."""

from __future__ import annotations

import copy

import pytest
import torch

from streamgrpo.models.batching import build_batch
from streamgrpo.models.logprobs import completion_logprobs
from tests.unit.models.test_logprobs import _grads, _load, _three_groups


def _frozen_trunk_model(path, heads_train: bool = True):
    """A copy of the tiny model with the vision trunk frozen (its mergers train unless ``heads_train`` is false)."""
    _, model = _load(path)
    m = copy.deepcopy(model).train()
    for name, p in m.named_parameters():
        if name.startswith("model.visual."):
            p.requires_grad_(heads_train and "merger" in name)  # merger, deepstack_merger_list
    return m


def _block_runs(*models):
    """A list that grows by one per real forward of any model's first vision block."""
    seen: list[int] = []
    hooks = [m.model.visual.blocks[0].register_forward_hook(lambda *_: seen.append(1)) for m in models]
    return seen, hooks


def _batch(proc, arch, cache):
    batch = build_batch(_three_groups(proc, arch), proc.tokenizer.pad_token_id)
    batch.vision_cache = cache
    return batch


@pytest.mark.parametrize("shared_prompt", [False, True], ids=["rows", "shared-prompt"])
def test_policy_and_reference_share_one_trunk_pass_with_unchanged_logprobs_and_gradients(tiny_any_dir, shared_prompt):
    proc, base = _load(tiny_any_dir)
    arch = base.config.model_type
    policy = _frozen_trunk_model(tiny_any_dir)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    assert any(p.requires_grad for n, p in policy.named_parameters() if "merger" in n)
    kw = dict(temperature=0.7, shared_prompt=shared_prompt)
    plain = _batch(proc, arch, None)
    cached = _batch(proc, arch, {})
    m = plain.completion_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        ref_plain, _ = completion_logprobs(reference, plain, **kw)
    g_plain = _grads(policy, lambda: completion_logprobs(policy, plain, **kw)[0], weights, m)

    seen, hooks = _block_runs(policy, reference)
    try:
        with torch.no_grad():  # the reference first, as in a learner step
            ref_cached, _ = completion_logprobs(reference, cached, **kw)
        g_cached = _grads(policy, lambda: completion_logprobs(policy, cached, **kw)[0], weights, m)
        with torch.no_grad():  # a probe of the same batch (learner.max_update_kl)
            probe, _ = completion_logprobs(policy, cached, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 2, "the trunk ran more than once per kind (images, videos) for the batch"
    assert cached.vision_cache and plain.vision_cache is None
    torch.testing.assert_close(ref_cached, ref_plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(probe, ref_plain, atol=1e-6, rtol=0)  # the same weights as the reference so far
    assert g_cached.keys() == g_plain.keys()
    heads = [k for k in g_plain if "merger" in k]
    assert heads and any(g_plain[k].abs().sum() > 0 for k in heads), "the mergers got no gradient"
    assert not any(k.startswith("model.visual.blocks") for k in g_plain)
    for k in g_plain:
        torch.testing.assert_close(g_cached[k], g_plain[k], atol=1e-6, rtol=1e-5, msg=lambda s, k=k: f"{k}: {s}")


def test_the_reference_replays_the_trunk_through_its_own_mergers(tiny_any_dir):
    """After a step the policy's mergers differ from the reference's: each model's features are its own."""
    proc, base = _load(tiny_any_dir)
    arch = base.config.model_type
    policy = _frozen_trunk_model(tiny_any_dir)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "merger" in n:
                p.add_(0.05 * torch.randn_like(p))
        want_ref, _ = completion_logprobs(reference, _batch(proc, arch, None))
        want_pol, _ = completion_logprobs(policy, _batch(proc, arch, None))
        cached = _batch(proc, arch, {})
        got_pol, _ = completion_logprobs(policy, cached)
        got_ref, _ = completion_logprobs(reference, cached)
    assert (want_pol - want_ref).abs().max() > 1e-4  # the two differ ...
    torch.testing.assert_close(got_pol, want_pol, atol=1e-6, rtol=0)  # ... and each gets its own
    torch.testing.assert_close(got_ref, want_ref, atol=1e-6, rtol=0)


def test_a_frozen_tower_with_frozen_mergers_is_encoded_once(tiny_model_dir):
    proc, base = _load(tiny_model_dir)
    policy = _frozen_trunk_model(tiny_model_dir, heads_train=False)
    assert not any(p.requires_grad for p in policy.model.visual.parameters())
    calls: list[int] = []
    hook = policy.model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        cached = _batch(proc, "qwen2_5_vl", {})
        with torch.no_grad():
            a, _ = completion_logprobs(policy, cached)
        b, _ = completion_logprobs(policy, cached)  # with gradients on: the decoder trains, the features are kept
        b.sum().backward()
    finally:
        hook.remove()
    assert len(calls) == 2  # once for the images, once for the videos
    torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=0)


def test_a_training_trunk_is_never_cached(tiny_model_dir):
    proc, model = _load(tiny_model_dir)
    cached = _batch(proc, "qwen2_5_vl", {})
    seen, hooks = _block_runs(model)
    try:
        with torch.no_grad():
            completion_logprobs(model, cached)
            completion_logprobs(model, cached)
    finally:
        for h in hooks:
            h.remove()
    assert cached.vision_cache == {} and len(seen) == 4  # images and videos, twice


def test_moving_a_batch_starts_an_empty_cache(tiny_model_dir):
    proc, _ = _load(tiny_model_dir)
    batch = _batch(proc, "qwen2_5_vl", {"x": 1})
    assert batch.to("cpu").vision_cache == {}
    assert _batch(proc, "qwen2_5_vl", None).to("cpu").vision_cache is None
