"""HF rollout engine on the tiny model: batched multi-prompt sampling, behaviour log-probs, weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgrpo.engines.base import PromptRequest, SamplingParams, cut_at_stop
from streamgrpo.engines.hf import HFEngine, collate_prompts, suppressed_token_ids
from streamgrpo.wire import Visual


def _video(size, frames, colour):
    v = np.full((frames, size, size, 3), 128, dtype=np.uint8)
    for t in range(frames):
        x = t * (size - 14) // max(frames - 1, 1)
        v[t, 20:34, x : x + 14] = colour
    return v


def _request(proc, frames, colour, question):
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    video = _video(56, frames, colour)
    inputs = proc(text=[text], videos=[video], return_tensors="pt",
                  videos_kwargs={"do_sample_frames": False, "fps": 2.0})
    return PromptRequest(text, [Visual("video", video, 2.0, np.arange(frames, dtype=np.int32))], inputs)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.loading import load_processor

    proc = load_processor(str(tiny_model_dir))
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    return HFEngine(model, proc)


def test_cut_at_stop():
    assert cut_at_stop(np.array([5, 6, 9, 7]), {9}) == (3, "stop")
    assert cut_at_stop(np.array([5, 6, 7]), {9}) == (3, "length")


def test_collate_left_pads_and_concatenates_visuals(engine):
    proc = engine.processor
    a = _request(proc, 8, (220, 30, 30), "Colour?")
    b = _request(proc, 4, (30, 220, 30), "What colour is the moving square shape?")
    batch = collate_prompts([a.inputs, b.inputs], pad_token_id=0)
    la, lb = a.inputs["input_ids"].shape[1], b.inputs["input_ids"].shape[1]
    width = max(la, lb)
    assert batch["input_ids"].shape == (2, width)
    assert torch.equal(batch["input_ids"][0, width - la:], a.inputs["input_ids"][0])
    assert torch.equal(batch["input_ids"][1, width - lb:], b.inputs["input_ids"][0])
    assert batch["attention_mask"].sum().item() == la + lb
    assert batch["video_grid_thw"].shape[0] == 2
    assert batch["pixel_values_videos"].shape[0] == a.inputs["pixel_values_videos"].shape[0] + b.inputs["pixel_values_videos"].shape[0]


def test_generate_groups_with_logprobs_and_no_vision_tokens(engine):
    proc = engine.processor
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue"),
            _request(proc, 4, (30, 30, 220), "Which colour?")]
    out = engine.generate(reqs, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0))
    assert len(out) == 2 and all(len(g) == 4 for g in out)
    banned = set(suppressed_token_ids(proc.tokenizer))
    assert banned, "the tiny tokenizer has vision tokens"
    for group in out:
        for c in group:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
            assert not banned & set(c.token_ids.tolist())
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in engine.stop_ids
            else:
                assert len(c.token_ids) == 8


def test_seed_makes_sampling_reproducible(engine):
    req = [_request(engine.processor, 8, (220, 30, 30), "Colour?")]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=123)
    a = engine.generate(req, sp)
    b = engine.generate(req, sp)
    assert [c.token_ids.tolist() for c in a[0]] == [c.token_ids.tolist() for c in b[0]]


def test_load_weights_in_place_and_checks(engine):
    name, p = next(iter(engine.model.named_parameters()))
    ptr = p.data_ptr()
    new = torch.full_like(p, 0.01)
    engine.load_weights(7, {name: new})
    assert engine.version == 7 and p.data_ptr() == ptr and torch.equal(p.detach(), new)
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights(8, {"nope.weight": new})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(8, {name: torch.zeros(3)})
    assert engine.version == 7
