"""Training batches and per-token log-probs of completions for Qwen2.5-VL and Qwen3-VL (tiny real models).

The references are independent of the code under test: one plain ``model(...)`` forward per row with
a full ``log_softmax``, and the sampling-time scores of ``model.generate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgrpo.metrics import ERRORS
from streamgrpo.models.batching import (
    BatchError,
    GroupInputs,
    build_batch,
    pad_right,
    prepare_batch,
    truncate_at_eos,
    vision_token_ids,
)
from streamgrpo.models.logprobs import completion_logprobs, per_row_logprobs

FRAME = {"qwen2_5_vl": 56, "qwen3_vl": 64}  # one 2x2 merged patch grid per 2 frames = 4 tokens
_LOADED: dict = {}


def _load(path):
    """(processor, float32 model in eval mode), loaded once per directory."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    key = str(path)
    if key not in _LOADED:
        proc = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        _LOADED[key] = (proc, model)
    return _LOADED[key]


def _frames(n: int, size: int, seed: int) -> np.ndarray:
    """A coloured square moving across a noisy background, n x size x size x 3 uint8."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 60, (n, size, size, 3), dtype=np.uint8)
    colour = rng.integers(120, 255, 3, dtype=np.uint8)
    side = size // 4
    for t in range(n):
        x = t * (size - side) // max(n - 1, 1)
        v[t, size // 3 : size // 3 + side, x : x + side] = colour
    return v


def _messages(question: str, kind: str | None):
    content = ([{"type": kind}] if kind else []) + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def _video_kwargs(videos):
    return {"do_sample_frames": False, "video_metadata": [
        {"fps": 2.0, "frames_indices": list(range(len(v))), "total_num_frames": len(v)} for v in videos]}


def _process(proc, questions, videos=None, images=None, padding=False):
    kind = "video" if videos is not None else ("image" if images is not None else None)
    texts = [proc.apply_chat_template(_messages(q, kind), add_generation_prompt=True, tokenize=False)
             for q in questions]
    kw = {}
    if videos is not None:
        kw.update(videos=list(videos), videos_kwargs=_video_kwargs(videos))
    if images is not None:
        kw.update(images=list(images))
    return proc(text=texts, return_tensors="pt", padding=padding, **kw)


def _random_completions(proc, lengths, seed):
    banned = set(vision_token_ids(proc))
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = [t for t in torch.randint(0, len(proc.tokenizer), (3 * n,), generator=g).tolist() if t not in banned]
        out.append(torch.tensor(ids[:n]))
    return out


def _three_groups(proc, arch):
    """Different videos (frame counts, sizes), an image, different prompt lengths and G."""
    s = FRAME[arch]
    a = _process(proc, ["Hi"], videos=[_frames(16, s, 1)])
    b = _process(proc, ["Which direction does the shape move? Answer with the option letter. (A) left (B) right"],
                 videos=[_frames(4, 2 * s, 2)])
    c = _process(proc, ["What colour is the square?"], images=[_frames(1, s, 3)[0]])
    return [
        GroupInputs.from_processor(a, _random_completions(proc, [5, 1, 7], seed=1)),
        GroupInputs.from_processor(b, _random_completions(proc, [3, 6], seed=2)),
        GroupInputs.from_processor(c, _random_completions(proc, [4, 2], seed=3)),
    ]


def _grads(model, fn, weights_BT, mask_BT):
    model.zero_grad(set_to_none=True)
    lp = fn()
    (lp * weights_BT * mask_BT).sum().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------------------ pure helpers
def test_truncate_at_eos_keeps_the_first_end_token_and_the_input_kind():
    assert truncate_at_eos([5, 6, 2, 7, 2], 2) == [5, 6, 2]
    assert truncate_at_eos([5, 6, 7], 2) == [5, 6, 7]
    assert truncate_at_eos([2, 5], 2) == [2]
    assert truncate_at_eos([], 2) == []
    assert truncate_at_eos([5, 9, 6, 2], [2, 9]) == [5, 9]
    t = truncate_at_eos(torch.tensor([4, 3, 1, 1]), 1)
    assert isinstance(t, torch.Tensor) and t.tolist() == [4, 3, 1]
    assert truncate_at_eos(torch.tensor([4, 3]), (1, 2)).tolist() == [4, 3]
    a = truncate_at_eos(np.array([4, 8, 3], dtype=np.int32), 8)
    assert isinstance(a, np.ndarray) and a.tolist() == [4, 8]


def test_pad_right():
    out = pad_right([torch.tensor([1, 2, 3]), [4]], 0)
    assert out.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert pad_right([[1.5]], -1.0, length=3, dtype=torch.float32).tolist() == [[1.5, -1.0, -1.0]]
    with pytest.raises(ValueError, match="row 0"):
        pad_right([[1, 2, 3]], 0, length=2)


def test_vision_token_ids_from_processor_and_config(tiny_any_dir):
    proc, model = _load(tiny_any_dir)
    from_proc = vision_token_ids(proc)
    from_cfg = vision_token_ids(model.config)
    cfg = model.config
    assert {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id} == set(from_cfg)
    assert set(from_cfg) <= set(from_proc)
    assert proc.tokenizer.convert_tokens_to_ids("<|vision_pad|>") in from_proc
    assert vision_token_ids(model) == from_cfg
    assert proc.tokenizer.convert_tokens_to_ids("<|im_end|>") not in from_proc


# ----------------------------------------------------------------------------- batch layout
def test_build_batch_layout_and_positions(tiny_any_dir):
    proc, model = _load(tiny_any_dir)
    arch = model.config.model_type
    groups = _three_groups(proc, arch)
    pad = proc.tokenizer.pad_token_id
    batch = build_batch(groups, pad, model=model)
    B = sum(g.num_completions for g in groups)
    lens = [len(c) for g in groups for c in g.completion_ids]
    assert batch.input_ids.shape[0] == B and batch.completion_mask.shape == (B, max(lens))
    assert batch.completion_mask.sum(1).tolist() == lens
    assert batch.row_group.tolist() == [0, 0, 0, 1, 1, 2, 2]
    b = 0
    for g in groups:
        P = g.prompt_ids.numel()
        for c in g.completion_ids:
            n = P + len(c)
            assert batch.input_ids[b, :n].tolist() == g.prompt_ids.tolist() + c.tolist()
            assert (batch.input_ids[b, n:] == pad).all()
            assert batch.attention_mask[b].tolist() == [1] * n + [0] * (batch.input_ids.shape[1] - n)
            assert batch.completion_ids[b, : len(c)].tolist() == c.tolist()
            # the logits at logit_index predict the completion token (next-token shift)
            idx = batch.logit_index[b, : len(c)]
            assert (batch.input_ids[b, idx + 1] == c).all()
            assert batch.mm_token_type_ids[b, :P].tolist() == g.mm_token_type_ids.tolist()
            assert (batch.mm_token_type_ids[b, P:] == 0).all()
            # positions: the model's own get_rope_index over the whole (unpadded) row
            full = torch.cat([g.prompt_ids, c])
            mm = torch.cat([g.mm_token_type_ids, torch.zeros(len(c), dtype=torch.long)])
            kw = {k: v for k, v in g.visual_kwargs().items() if k.endswith("_thw") or k == "second_per_grid_ts"}
            with torch.no_grad():
                ref, _ = model.model.get_rope_index(full[None], mm_token_type_ids=mm[None], **kw)
            assert torch.equal(batch.position_ids[:, b, :n], ref[:, 0])
            b += 1


def test_prompt_positions_match_a_left_padded_processor_batch(tiny_any_dir):
    """Per-group positions equal what the model computes for the padded multi-prompt batch."""
    proc, model = _load(tiny_any_dir)
    s = FRAME[model.config.model_type]
    qs = ["Hi", "Which direction does the shape move? Answer with the option letter."]
    vids = [_frames(16, s, 4), _frames(6, 2 * s, 5)]
    proc.tokenizer.padding_side = "left"
    padded = _process(proc, qs, videos=vids, padding=True)
    mask = padded["attention_mask"].bool()
    kw = {k: padded[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in padded}
    with torch.no_grad():
        ref, _ = model.model.get_rope_index(padded["input_ids"], mm_token_type_ids=padded["mm_token_type_ids"],
                                            attention_mask=padded["attention_mask"], **kw)
    groups = [GroupInputs.from_processor(_process(proc, [q], videos=[v]), [torch.tensor([7])]) for q, v in zip(qs, vids)]
    batch = build_batch(groups, proc.tokenizer.pad_token_id, model=model)
    for i, g in enumerate(groups):
        assert g.prompt_ids.tolist() == padded["input_ids"][i][mask[i]].tolist()
        P = g.prompt_ids.numel()
        assert torch.equal(batch.position_ids[:, i, :P], ref[:, i][:, mask[i]])


def test_build_batch_rejects_bad_groups_with_a_clear_counted_error(tiny_model_dir):
    proc, model = _load(tiny_model_dir)
    feats = _process(proc, ["Hi"], videos=[_frames(4, FRAME["qwen2_5_vl"], 0)])
    errors = ERRORS.labels(kind="batch")
    before = errors._value.get()
    bad = GroupInputs.from_processor(feats, [torch.tensor([5, 6]), torch.tensor([5, model.config.video_token_id])])
    ok = GroupInputs.from_processor(feats, [torch.tensor([5])])
    with pytest.raises(BatchError, match="group 1, completion 1: contains a vision token"):
        build_batch([ok, bad], proc.tokenizer.pad_token_id, model=model)
    short = GroupInputs.from_processor(feats, [torch.tensor([5])])
    short.video_grid_thw = torch.tensor([[4, 4, 4]])  # 16 features for 8 placeholders
    with pytest.raises(BatchError, match="group 0: prompt has 8 video placeholder tokens but the video grids give 16"):
        build_batch([short], proc.tokenizer.pad_token_id, model=model)
    with pytest.raises(BatchError, match="no prompt_position_ids"):
        prepare_batch(build_batch([GroupInputs.from_processor(feats, [torch.tensor([5])])], 0))
    # built without the model (as the learner does), checked on first use
    lazy = build_batch([ok, bad], proc.tokenizer.pad_token_id)
    assert lazy.position_ids is None and not lazy.validated
    with pytest.raises(BatchError, match="group 1, completion 1: contains a vision token"):
        completion_logprobs(model, lazy)
    assert errors._value.get() == before + 4


def test_batch_built_without_the_model_gives_the_same_logprobs(tiny_any_dir):
    proc, model = _load(tiny_any_dir)
    groups = _three_groups(proc, model.config.model_type)
    eager = build_batch(groups, proc.tokenizer.pad_token_id, model=model)
    lazy = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id)
    with torch.no_grad():
        lp_lazy, _ = completion_logprobs(model, lazy, temperature=0.7)
        lp_eager, _ = completion_logprobs(model, eager, temperature=0.7)
    assert lazy.validated and torch.equal(lazy.position_ids, eager.position_ids)
    torch.testing.assert_close(lp_lazy, lp_eager, atol=0, rtol=0)
    # positions are cached per group: a second batch of the same groups needs no model
    again = build_batch(groups, proc.tokenizer.pad_token_id)
    assert torch.equal(again.position_ids, eager.position_ids)


# ------------------------------------------------------------------ shared vision == naive
def test_shared_vision_equals_per_row_forward_logprobs_and_grads(tiny_any_dir):
    proc, model = _load(tiny_any_dir)
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    m = batch.completion_mask
    with torch.no_grad():
        shared, ent_shared = completion_logprobs(model, batch, temperature=0.7, with_entropy=True)
        naive, ent_naive = completion_logprobs(model, batch, temperature=0.7, with_entropy=True, shared_vision=False)
        per_row, ent_row = per_row_logprobs(model, batch, temperature=0.7)
    assert shared.dtype == torch.float32 and shared.shape == m.shape
    assert (shared[~m] == 0).all() and (shared[m] < 0).all()
    torch.testing.assert_close(shared, per_row, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared, naive, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_shared, ent_row, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_shared, ent_naive, atol=1e-5, rtol=0)

    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    g_shared = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7)[0], weights, m)
    g_row = _grads(model, lambda: per_row_logprobs(model, batch, temperature=0.7)[0], weights, m)
    assert g_shared.keys() == g_row.keys()
    assert any(k.startswith("model.visual.") and g_row[k].abs().sum() > 0 for k in g_row), "vision got no gradient"
    for k in g_row:
        torch.testing.assert_close(g_shared[k], g_row[k], atol=1e-5, rtol=1e-5, msg=lambda s, k=k: f"{k}: {s}")


def test_vision_encoder_runs_once_per_group(tiny_any_dir):
    proc, model = _load(tiny_any_dir)
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    seen = []
    hook = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(int(args[0].shape[0])))
    try:
        with torch.no_grad():
            seen.clear()
            completion_logprobs(model, batch, shared_vision=True)
            shared_patches = sum(seen)
            seen.clear()
            completion_logprobs(model, batch, shared_vision=False)
            naive_patches = sum(seen)
    finally:
        hook.remove()
    per_group = [sum(int(t.shape[0]) for t in (g.pixel_values, g.pixel_values_videos) if t is not None)
                 for g in batch.groups]
    assert shared_patches == sum(per_group)
    assert naive_patches == sum(p * g.num_completions for p, g in zip(per_group, batch.groups))


def test_one_vision_call_for_images_and_videos_changes_nothing(tiny_any_dir):
    """``TrainBatch.one_vision_call`` (DeepSpeed ZeRO-3 on several ranks): the images and the videos go through the
    encoder in one call, not one per kind, with the same log-probs and gradients."""
    proc, model = _load(tiny_any_dir)
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    m = batch.completion_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    results = {}
    try:
        for one in (False, True):
            batch.one_vision_call = one
            calls.clear()
            with torch.no_grad():
                lp, ent = completion_logprobs(model, batch, temperature=0.7, with_entropy=True)
            grads = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7)[0], weights, m)
            results[one] = (lp, ent, grads, len(calls))
    finally:
        hook.remove()
    (lp0, ent0, g0, calls0), (lp1, ent1, g1, calls1) = results[False], results[True]
    assert (calls0, calls1) == (2 * 2, 1 * 2)  # image and video apart, or together (the no-grad and grad forwards)
    # float32 sums over other row counts (the encoder's matmuls over both kinds' patches): the bounds of the test above
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    assert g1.keys() == g0.keys() and any(k.startswith("model.visual.") and g0[k].abs().sum() > 0 for k in g0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-5, msg=lambda s, k=k: f"{k}: {s}")


def test_a_vision_stand_in_changes_nothing_and_calls_the_encoder(tiny_any_dir):
    """``TrainBatch.vision_stand_in`` (ZeRO-3: another rank's micro-batch has a visual, this one's none): the encoder
    runs over a stand-in in each forward, its backward too, and the log-probs and gradients are those without it."""
    proc, model = _load(tiny_any_dir)
    group = GroupInputs.from_processor(_process(proc, ["What is two and two?"]), _random_completions(proc, [4, 6], seed=4))
    batch = build_batch([group], proc.tokenizer.pad_token_id, model=model)
    m = batch.completion_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    calls = []
    hooks = [model.model.visual.register_forward_hook(lambda *_: calls.append("forward")),
             model.model.visual.merger.register_full_backward_hook(lambda *_: calls.append("backward"))]
    results = {}
    try:
        for stand_in in (False, True):
            batch.one_vision_call = batch.vision_stand_in = stand_in
            calls.clear()
            grads = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7)[0], weights, m)
            results[stand_in] = (completion_logprobs(model, batch, temperature=0.7)[0].detach(), grads, list(calls))
    finally:
        for h in hooks:
            h.remove()
    (lp0, g0, calls0), (lp1, g1, calls1) = results[False], results[True]
    assert calls0 == [] and calls1 == ["forward", "backward", "forward"]
    torch.testing.assert_close(lp1, lp0, atol=0, rtol=0)
    assert g1.keys() >= g0.keys() and {k for k in g1 if k not in g0} and all(
        k.startswith("model.visual.") and not g1[k].any() for k in g1 if k not in g0)  # the stand-in's: zeros
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=0, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


def test_chunking_and_recompute_change_nothing(tiny_model_dir):
    proc, model = _load(tiny_model_dir)
    batch = build_batch(_three_groups(proc, "qwen2_5_vl"), proc.tokenizer.pad_token_id, model=model)
    m = batch.completion_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(1))
    runs = [dict(chunk_tokens=1, recompute=True), dict(chunk_tokens=5, recompute=False), dict(chunk_tokens=4096)]
    results = []
    for kw in runs:
        g = _grads(model, lambda kw=kw: completion_logprobs(model, batch, **kw)[0], weights, m)
        with torch.no_grad():
            lp, _ = completion_logprobs(model, batch, **kw)
        results.append((lp, g))
    for lp, g in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-6, rtol=0)
        for k in g:
            torch.testing.assert_close(g[k], results[0][1][k], atol=1e-5, rtol=1e-5)


def test_lora_policy_and_adapter_disabled_reference(tiny_any_dir):
    from peft import LoraConfig, get_peft_model

    proc, base = _load(tiny_any_dir)
    batch = build_batch(_three_groups(proc, base.config.model_type)[:2], proc.tokenizer.pad_token_id, model=base)
    with torch.no_grad():
        lp_base, _ = completion_logprobs(base, batch)
    # a throwaway copy: peft injects layers in place
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_any_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    m = batch.completion_mask
    with torch.no_grad():
        lp, _ = completion_logprobs(peft_model, batch)
        lp_row, _ = per_row_logprobs(peft_model, batch)
        with peft_model.disable_adapter():
            lp_ref, _ = completion_logprobs(peft_model, batch)
    torch.testing.assert_close(lp, lp_row, atol=1e-5, rtol=0)
    assert (lp - lp_base)[m].abs().max() > 1e-3  # the adapters do something
    torch.testing.assert_close(lp_ref, lp_base, atol=1e-6, rtol=0)
    lp, _ = completion_logprobs(peft_model, batch)
    (lp * m).sum().backward()
    trained = [n for n, p in peft_model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)


# ------------------------------------------------------------------- alignment with sampling
def test_logprobs_match_generate_at_temperature(tiny_any_dir):
    """Sample from a left-padded batch of prompts with videos of different lengths; recompute."""
    proc, model = _load(tiny_any_dir)
    s = FRAME[model.config.model_type]
    qs = ["Hi", "Which direction does the shape move? Answer with the option letter.", "What colour?"]
    vids = [_frames(16, s, 11), _frames(4, s, 12), _frames(8, 2 * s, 13)]
    proc.tokenizer.padding_side = "left"
    inputs = _process(proc, qs, videos=vids, padding=True)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) == 3  # really padded
    banned = vision_token_ids(proc)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # extra end tokens so that some completions stop early: variable lengths, padding after the end
    ends = [im_end, *range(100, 140)]
    G, temp = 2, 0.7
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, temperature=temp, top_k=0, top_p=1.0, max_new_tokens=12,
                             num_return_sequences=G, eos_token_id=ends, suppress_tokens=banned,
                             output_scores=True, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, inputs["input_ids"].shape[1]:]
    scores = torch.stack(out.scores, 1).float()  # processed: suppressed tokens at -inf, divided by temp
    raw = torch.stack(out.logits, 1).float()
    groups, sampled, sampled_raw = [], [], []
    for i, (q, v) in enumerate(zip(qs, vids)):
        comps = []
        for r in range(i * G, (i + 1) * G):
            c = truncate_at_eos(new[r], ends)
            comps.append(c)
            steps = torch.arange(len(c))
            sampled.append(torch.log_softmax(scores[r, : len(c)], -1)[steps, c])
            sampled_raw.append(torch.log_softmax(raw[r, : len(c)] / temp, -1)[steps, c])
            assert not torch.isin(c, torch.tensor(banned)).any()
        groups.append(GroupInputs.from_processor(_process(proc, [q], videos=[v]), comps))
    lengths = [len(c) for g in groups for c in g.completion_ids]
    assert len(set(lengths)) > 1, lengths
    batch = build_batch(groups, proc.tokenizer.pad_token_id, model=model)
    behaviour = pad_right(sampled, 0.0, dtype=torch.float32)
    behaviour_raw = pad_right(sampled_raw, 0.0, dtype=torch.float32)
    m = batch.completion_mask
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=temp, suppress_token_ids=banned)
        lp_full, _ = completion_logprobs(model, batch, temperature=temp)
    torch.testing.assert_close(lp[m], behaviour[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(lp_full[m], behaviour_raw[m], atol=1e-4, rtol=0)
    # suppression renormalises: the two distributions really differ on this random model
    assert (lp - lp_full)[m].abs().min() > 1e-4


def test_entropy_gradient_only_when_asked_and_through_recompute():
    from streamgrpo.models.logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(7, 8, requires_grad=True)
    ids = torch.randint(0, 11, (7,))
    _, ent = chunked_token_logprobs(h, ids, head, temperature=0.7, with_entropy=True, chunk_tokens=3)
    assert not ent.requires_grad  # a metric by default
    _, ent = chunked_token_logprobs(h, ids, head, temperature=0.7, with_entropy=True, entropy_grad=True,
                                    chunk_tokens=3, recompute=True)
    (g_h,) = torch.autograd.grad(ent.sum(), h)
    p = torch.softmax(head(h) / 0.7, -1)  # the reference: full logits, no chunks
    ref = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(ent, ref, atol=1e-5, rtol=1e-5)
    (g_ref,) = torch.autograd.grad(ref.sum(), h)
    torch.testing.assert_close(g_h, g_ref, atol=1e-5, rtol=1e-5)
    # suppressed tokens (-inf logits, p = 0) and far-off ones (p underflows to 0) keep it finite
    with torch.no_grad():
        head.weight[3] *= 1e4
    _, ent = chunked_token_logprobs(h, ids, head, suppress_token_ids=[0, 5], with_entropy=True,
                                    entropy_grad=True, chunk_tokens=3)
    (g_h,) = torch.autograd.grad(ent.sum(), h)
    assert torch.isfinite(ent).all() and torch.isfinite(g_h).all() and (ent >= 0).all()


@pytest.mark.parametrize("recompute", [True, False])
def test_min_chunks_calls_the_head_as_often_in_forward_and_backward_and_changes_nothing(recompute):
    """DeepSpeed ZeRO-3 gathers the head's weight at each call, collectively: a rank whose tokens need 2 chunks
    makes 4 calls when another rank needs 4, over no rows, in its backward too (no rows at all: 4 as well)."""
    from streamgrpo.models.logprobs import chunked_token_logprobs, head_chunks

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    forwards, backwards = [], []
    head.register_forward_hook(lambda m, a, out: forwards.append(a[0].shape[0]))
    head.register_full_backward_hook(lambda m, gi, go: backwards.append(go[0].shape[0]))
    h = torch.randn(5, 8, requires_grad=True)
    ids = torch.randint(0, 11, (5,))
    assert head_chunks(5, 3) == 2 and head_chunks(0, 3) == 0 and head_chunks(6, 3) == 2
    plain, _ = chunked_token_logprobs(h, ids, head, chunk_tokens=3, recompute=recompute)
    (g_plain,) = torch.autograd.grad(plain.sum(), h)
    forwards.clear(), backwards.clear()
    padded, _ = chunked_token_logprobs(h, ids, head, chunk_tokens=3, recompute=recompute, min_chunks=4)
    (g_padded,) = torch.autograd.grad(padded.sum(), h)
    assert torch.equal(padded, plain) and torch.equal(g_padded, g_plain)
    per_pass = [3, 2, 0, 0]
    assert forwards[:4] == per_pass and sorted(forwards[4:]) == (sorted(per_pass) if recompute else [])
    assert sorted(backwards) == sorted(per_pass)
    forwards.clear(), backwards.clear()
    none, _ = chunked_token_logprobs(h[:0], ids[:0], head, chunk_tokens=3, recompute=recompute, min_chunks=4)
    (none.sum() + (h * 0).sum()).backward()
    assert none.shape == (0,) and forwards[:4] == [0] * 4 and len(backwards) == 4
