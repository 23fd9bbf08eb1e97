"""The vision tower's attention in one packed call per block (streamgrpo/models/vision_attention.py): the same
features, log-probs, loss and gradients as transformers' per-chunk path, on both tiny architectures, with a
video whose edge windows are ragged and images of different sizes in one batch; one sdpa call per block."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from streamgrpo.loss import LossSpec, compute_loss
from streamgrpo.models.batching import GroupInputs, build_batch
from streamgrpo.models.logprobs import completion_logprobs
from streamgrpo.models.vision_attention import NAMES, PAD_BUDGET, buckets, install, plan
from tests.unit.models.test_logprobs import _frames, _load, _process, _random_completions

# one merged unit is 28 pixels (Qwen2.5-VL: 14-pixel patches, 2x2 merge; 56-pixel windows of 2x2 units) or 32
# (Qwen3-VL); 3 x 3 units: Qwen2.5-VL's windows are 2x2, 2x1, 1x2, 1x1 units (16, 8, 8, 4 patches)
UNIT = {"qwen2_5_vl": 28, "qwen3_vl": 32}


# ------------------------------------------------------------------------------ the plan (pure)
def _check_plan(lengths):
    p = plan(lengths)
    n = sum(lengths)
    tokens = torch.arange(n, dtype=torch.float64)
    outs, seen = [], []
    for call in p.calls:
        slots = tokens if call.gather is None else tokens[call.gather]
        slots = slots.view(call.count, call.length)
        if call.keep is not None:
            assert call.keep.shape == (call.count, call.length)
            seen += slots[call.keep].tolist()
        else:
            seen += slots.flatten().tolist()
        outs.append(slots.flatten())
    flat = torch.cat(outs)
    back = flat if p.scatter is None else flat[p.scatter]
    assert back.tolist() == tokens.tolist(), "a token's output does not come back to its place"
    assert sorted(seen) == tokens.tolist(), "a token is in no call, or in two"
    return p


def test_equal_chunks_are_one_call_with_no_copy_and_no_mask():
    p = _check_plan([64] * 128)
    assert len(p.calls) == 1 and p.scatter is None
    c = p.calls[0]
    assert (c.count, c.length, c.gather, c.keep) == (128, 64, None, None)


def test_ragged_edge_windows_are_one_call_with_a_key_mask():
    lengths = [16, 8, 8, 4] * 3  # a 3 x 3-unit frame's 2x2-unit windows (the worst case), three frames
    p = _check_plan(lengths)
    assert len(p.calls) == 1
    c = p.calls[0]
    assert (c.count, c.length) == (12, 16) and c.keep is not None
    assert c.keep.sum(1).tolist() == sorted(lengths, reverse=True)  # longest first


def test_very_unequal_chunks_split_into_calls_within_the_padding_budget():
    lengths = [1024, *[64] * 8, 0, 16]
    assert sorted(i for g in buckets(lengths) for i in g) == [*range(9), 10]  # the empty chunk is in no call
    p = _check_plan(lengths)
    assert len(p.calls) == 2  # the large image and three small ones; the other small ones
    for g in buckets(lengths):
        longest = max(lengths[i] for i in g)
        assert len(g) * longest**2 <= PAD_BUDGET * sum(lengths[i] ** 2 for i in g)
    assert len(_check_plan([7]).calls) == 1


# ------------------------------------------------------------------------------ the real towers
def _model(path, impl: str = "sdpa"):
    """A float32 copy of the tiny model (attention ``impl``), all trainable, vision tower included."""
    from transformers import AutoModelForImageTextToText

    if impl == "sdpa":
        return copy.deepcopy(_load(path)[1]).train()
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).train()


def _groups(proc, arch):
    """A 4-frame video of 3 x 3 units (ragged windows) and two images of different sizes, in one batch."""
    u = UNIT[arch]
    video = _process(proc, ["What moves?"], videos=[_frames(4, 3 * u, 1)])
    small = _process(proc, ["Colour?"], images=[_frames(1, 2 * u, 2)[0]])
    wide = _process(proc, ["Shape?"], images=[_frames(1, 5 * u, 3)[0][: 3 * u]])
    return [GroupInputs.from_processor(video, _random_completions(proc, [5, 3], seed=1)),
            GroupInputs.from_processor(small, _random_completions(proc, [4, 6], seed=2)),
            GroupInputs.from_processor(wide, _random_completions(proc, [2, 7], seed=3))]


def _step(model, batch):
    """Log-probs, a GRPO loss with a KL term, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    lp, _ = completion_logprobs(model, batch, temperature=0.9)
    m = batch.completion_mask.float()
    adv = torch.linspace(-1.0, 1.0, m.shape[0])
    loss, _ = compute_loss(lp, lp.detach() + 0.01, adv, m, lp.detach() - 0.02, spec=LossSpec(beta=0.04))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), loss.detach(), grads


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_vision_attention_matches_the_per_chunk_path(tiny_any_dir, impl, monkeypatch):
    from streamgrpo.models import vision_attention

    plans: list[list[int]] = []
    real_plan = vision_attention.plan
    monkeypatch.setattr(vision_attention, "plan", lambda lengths, *a: plans.append(lengths) or real_plan(lengths, *a))
    proc, base = _load(tiny_any_dir)
    arch = base.config.model_type
    model = _model(tiny_any_dir, impl)
    batch = build_batch(_groups(proc, arch), proc.tokenizer.pad_token_id)
    if arch == "qwen2_5_vl":
        cfg = model.config.vision_config
        assert cfg.fullatt_block_indexes and len(cfg.fullatt_block_indexes) < cfg.depth  # windows and full blocks
    lp_a, loss_a, g_a = _step(model, batch)
    assert install(model) == NAMES[impl]
    lp_b, loss_b, g_b = _step(model, batch)
    assert install(model, on=False) == impl
    assert [36, 36] in plans  # the video's frames (Qwen3-VL's blocks, Qwen2.5-VL's full-attention block)
    assert [16, 60] in plans  # two images of different sizes in one call
    if arch == "qwen2_5_vl":
        assert [16, 8, 8, 4] * 2 in plans  # its ragged windows
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    assert g_a.keys() == g_b.keys()
    blocks = [k for k in g_a if k.startswith("model.visual.blocks.")]
    assert blocks and all(g_a[k].abs().sum() > 0 for k in blocks if k.endswith("qkv.weight"))  # gradients flow
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], atol=1e-5, rtol=1e-4, msg=lambda s, k=k: f"{k}: {s}")


def test_the_frozen_trunk_path_gets_the_same_features(tiny_any_dir):
    """With the trunk frozen (vision_trunk's one pass per batch, under no_grad) the packed kernel serves too."""
    proc, base = _load(tiny_any_dir)
    arch = base.config.model_type
    model = _model(tiny_any_dir).eval()
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("model.visual.") or "merger" in n)
    want, _ = completion_logprobs(model, build_batch(_groups(proc, arch), proc.tokenizer.pad_token_id))
    install(model)
    batch = build_batch(_groups(proc, arch), proc.tokenizer.pad_token_id)
    batch.vision_cache = {}
    got, _ = completion_logprobs(model, batch)
    assert batch.vision_cache, "the frozen trunk was not cached"
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=0)


def _sdpa_calls_per_block(model, pixels, grid, monkeypatch):
    calls: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    with torch.no_grad():
        model.model.visual(pixels, grid_thw=grid)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    return len(calls) / len(model.model.visual.blocks)


def test_one_sdpa_call_per_vision_block_per_pass(tiny_any_dir, monkeypatch):
    proc, base = _load(tiny_any_dir)
    model = _model(tiny_any_dir).eval()
    c = model.config.vision_config
    grid = torch.tensor([[4, 6, 6], [1, 4, 4], [1, 6, 10]])  # a ragged video, two images of different sizes
    pixels = torch.randn(int(grid.prod(1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size**2)
    per_chunk = _sdpa_calls_per_block(model, pixels, grid, monkeypatch)
    install(model)
    assert _sdpa_calls_per_block(model, pixels, grid, monkeypatch) == 1
    assert per_chunk > 3  # transformers' own path: one call per window or frame


def test_load_model_packs_sdpa_and_leaves_flash_and_the_saved_config_alone(tiny_model_dir, tmp_path):
    from streamgrpo.config import build_config
    from streamgrpo.models.loading import load_model

    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32"])
    model = load_model(cfg.model, "cpu")
    assert model.model.visual.config._attn_implementation == NAMES["sdpa"]
    assert model.config.text_config._attn_implementation == "sdpa"  # the decoder keeps its kernel
    copy.deepcopy(model).save_pretrained(tmp_path)
    assert "streamgrpo" not in (tmp_path / "config.json").read_text()
    json.loads((tmp_path / "config.json").read_text())
    install(model, on=False)
    model.model.visual.config._attn_implementation = "flash_attention_2"  # transformers' varlen call: kept
    assert install(model) == "flash_attention_2"
    assert install(torch.nn.Linear(2, 2)) is None
