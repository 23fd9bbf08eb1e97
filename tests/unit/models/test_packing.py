"""Shared-prompt packing (streamgrpo/models/packing.py): the layout and mask by hand, and the same
log-probs and gradients as one row per completion on the tiny Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

import pytest
import torch

from streamgrpo.models.batching import BatchError, GroupInputs, build_batch
from streamgrpo.models.packing import attention_mask_for, block_mask, pack_batch


def _group(prompt, comps, start=0):
    ids = torch.tensor(prompt)
    pos = torch.arange(start, start + len(prompt)).expand(3, -1).clone()
    return GroupInputs(prompt_ids=ids, completion_ids=[torch.tensor(c) for c in comps], prompt_position_ids=pos)


def test_pack_batch_layout_by_hand():
    # group 0: prompt (11 12 13), completions (21 22) and (31); group 1: prompt (41), completion (51 52 53)
    batch = build_batch([_group([11, 12, 13], [[21, 22], [31]]), _group([41], [[51, 52, 53]], start=5)], 0)
    packed = pack_batch(batch, pad_token_id=0)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 31], [41, 51, 52, 53, 0, 0]]
    assert packed.segment_NL.tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, -1, -1]]
    # completions continue from the prompt's last position, each on its own
    assert packed.position_ids[0].tolist() == [[0, 1, 2, 3, 4, 3], [5, 6, 7, 8, 0, 0]]
    assert torch.equal(packed.position_ids[0], packed.position_ids[2])
    # the first token of every completion is predicted from the prompt's last position
    assert packed.logit_pos_BT.tolist() == [[2, 3, 0], [2, 0, 0], [0, 1, 2]]
    assert packed.num_tokens == 10 < batch.num_tokens == 13
    assert packed.row_group.tolist() == [0, 0, 1]


def test_block_mask_by_hand():
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = block_mask(seg)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # completion 1: the prompt and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # completion 2: the prompt, not completion 1
        [0, 0, 0, 0, 0, 1],  # pad: itself only (no empty row)
    ]
    eager = attention_mask_for(seg, "eager", torch.float32)
    assert eager.dtype == torch.float32 and (eager[0, 0] == 0).int().tolist() == m
    assert (eager[0, 0][eager[0, 0] != 0] == torch.finfo(torch.float32).min).all()
    assert attention_mask_for(seg, "sdpa", torch.float32).dtype == torch.bool
    with pytest.raises(BatchError, match="sdpa or eager"):
        attention_mask_for(seg, "flash_attention_2", torch.bfloat16)


def test_pack_batch_needs_positions():
    batch = build_batch([GroupInputs(prompt_ids=torch.tensor([1, 2]), completion_ids=[torch.tensor([3])])], 0)
    with pytest.raises(BatchError, match="prepare_batch"):
        pack_batch(batch, 0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_equals_rows_logprobs_entropy_and_grads(tiny_any_dir, attn):
    from test_logprobs import _grads, _three_groups
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.models.logprobs import completion_logprobs, per_row_logprobs

    proc = AutoProcessor.from_pretrained(tiny_any_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_any_dir, dtype=torch.float32,
                                                        attn_implementation=attn).eval()
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    m = batch.completion_mask
    with torch.no_grad():
        shared, ent_shared = completion_logprobs(model, batch, temperature=0.7, with_entropy=True, shared_prompt=True)
        per_row, ent_row = per_row_logprobs(model, batch, temperature=0.7)
    assert (shared[~m] == 0).all() and (shared[m] < 0).all()
    torch.testing.assert_close(shared, per_row, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_shared, ent_row, atol=1e-5, rtol=0)
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    g_shared = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7, shared_prompt=True)[0],
                      weights, m)
    g_row = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7)[0], weights, m)
    assert g_shared.keys() == g_row.keys()
    assert any(k.startswith("model.visual.") and g_row[k].abs().sum() > 0 for k in g_row), "vision got no gradient"
    for k in g_row:
        torch.testing.assert_close(g_shared[k], g_row[k], atol=1e-5, rtol=1e-4, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_shared_prompt_in_bf16_stays_inside_the_stated_tolerance(tiny_any_dir, device):
    """bf16 weights, sdpa (on CUDA: the kernels a real run uses), the LM head scaled to a trained model's
    logit spread (std 3, so log-probs depend on the context): the packed layout's log-probs against the
    row layout's stay within BF16_LOGPROB_TOL per token and BF16_LOGPROB_MEAN_TOL on average."""
    from test_logprobs import _three_groups
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.models.logprobs import (
        BF16_LOGPROB_MEAN_TOL,
        BF16_LOGPROB_TOL,
        completion_logprobs,
        last_hidden_states,
    )

    proc = AutoProcessor.from_pretrained(tiny_any_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_any_dir, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0 / float(model.lm_head(last_hidden_states(model, batch)).std()))
    model = model.to(device=device, dtype=torch.bfloat16)
    batch = batch.to(device)
    m = batch.completion_mask
    with torch.no_grad():
        shared, _ = completion_logprobs(model, batch, temperature=0.7, shared_prompt=True)
        rows, _ = completion_logprobs(model, batch, temperature=0.7)
    d = (shared - rows)[m].abs()
    assert torch.isfinite(shared[m]).all() and (shared[m] < 0).all()
    assert rows[m].std() > 1.0  # the log-probs really depend on the context at this spread
    assert d.max().item() <= BF16_LOGPROB_TOL and d.mean().item() <= BF16_LOGPROB_MEAN_TOL, (d.max(), d.mean())
