"""vLLM's settings derived from the data limits (streamgrpo/engines/vllm_settings.py; pure, no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from streamgrpo.config import build_config
from streamgrpo.engines.vllm import llm_kwargs
from streamgrpo.engines.vllm_settings import (
    TEMPLATE_TOKENS,
    TOKENS_PER_FRAME_GROUP,
    DataShape,
    derive,
    model_max_len,
    prompt_tokens,
    record_shape,
    settings,
)


def _long(**kw) -> DataShape:
    """Video-R1's per-frame budget (128 x 28 x 28) at 1,024 frames, one video, Qwen2.5-VL's factors."""
    base = dict(max_frames=1024, max_pixels=128 * 28 * 28, total_pixels=1024 * 128 * 28 * 28, videos=1, images=0,
                question_chars=300, completion_tokens=768)
    return DataShape(**{**base, **kw})


def test_a_long_video_config_gets_a_length_that_holds_its_longest_prompt():
    s = _long()
    visual = 512 * 128  # 1,024 frames in groups of 2, 128 tokens each
    assert prompt_tokens(s) == visual + 512 * TOKENS_PER_FRAME_GROUP + 300 + TEMPLATE_TOKENS
    d = derive(s, model_max_len=128_000)
    assert d["max_model_len"] % 256 == 0 and prompt_tokens(s) + 768 <= d["max_model_len"] < prompt_tokens(s) + 768 + 256
    assert d["max_num_batched_tokens"] >= visual  # one whole video prefills in one step
    assert d["max_num_batched_tokens"] <= d["max_model_len"]
    assert d["limit_mm_per_prompt"] == {"video": {"count": 1, "num_frames": 1024, "width": 308, "height": 308},
                                        "image": {"count": 0, "width": 308, "height": 308}}


def test_the_derived_length_is_capped_by_the_model_and_the_pixel_budget():
    assert derive(_long(), model_max_len=32_768)["max_model_len"] == 32_768
    assert derive(_long(), model_max_len=None)["max_model_len"] <= 128_000
    capped = _long(total_pixels=16 * 128 * 28 * 28)  # the sample's pixel budget: 16 frames' worth
    assert prompt_tokens(capped) < prompt_tokens(_long()) - 60_000
    short = derive(DataShape(max_frames=16, max_pixels=128 * 28 * 28, total_pixels=1 << 30, videos=1, images=0,
                             question_chars=200, completion_tokens=512), model_max_len=128_000)
    assert short["max_model_len"] < 4096 and short["max_num_batched_tokens"] == short["max_model_len"]


def test_explicit_settings_win():
    d = derive(_long(), model_max_len=128_000)
    assert settings(d) == d
    mine = settings(d, max_model_len=40_000, max_num_batched_tokens=4096, limit_mm_per_prompt={"video": 2})
    assert mine["max_model_len"] == 40_000 and mine["max_num_batched_tokens"] == 4096
    assert mine["limit_mm_per_prompt"] == {"video": 2}
    # a user's shorter max_model_len also bounds the derived prefill budget
    assert settings(d, max_model_len=16_384)["max_num_batched_tokens"] == 16_384


def test_llm_kwargs_use_the_derived_settings_where_the_config_is_null(tiny_model_dir):
    d = derive(_long(), model_max_len=128_000)
    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}"])
    kw = llm_kwargs(cfg, limits=d["limit_mm_per_prompt"], seed=0, derived=d)
    assert kw["max_model_len"] == d["max_model_len"] and kw["max_num_batched_tokens"] == d["max_num_batched_tokens"]
    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "rollout.vllm.max_model_len=20000",
                            "rollout.vllm.max_num_batched_tokens=2048"])
    kw = llm_kwargs(cfg, limits={}, seed=0, derived=d)
    assert kw["max_model_len"] == 20000 and kw["max_num_batched_tokens"] == 2048
    plain = llm_kwargs(build_config({}, [f"model.name_or_path={tiny_model_dir}"]), limits={}, seed=0)
    assert "max_num_batched_tokens" not in plain and "max_model_len" not in plain  # nothing derived, nothing set


def test_record_shape_takes_the_largest_record_and_falls_back_to_max_question_chars():
    cfg = build_config({}, ["data.max_frames=64", "data.max_question_chars=5000", "rollout.max_completion_length=99"])
    s = record_shape([(1, 0), (2, 1), (0, 3)], [10, 250, 40], data=cfg.data, rollout=cfg.rollout, factor=32)
    assert (s.videos, s.images, s.question_chars, s.max_frames, s.completion_tokens, s.factor) == (2, 3, 250, 64, 99, 32)
    assert record_shape([(1, 0)], [], data=cfg.data, rollout=cfg.rollout).question_chars == 5000
    cfg = build_config({}, ["data.system_prompt=You are a careful video analyst."])
    assert record_shape([(1, 0)], [10], data=cfg.data, rollout=cfg.rollout).question_chars == 10 + 32


def test_model_max_len_reads_the_text_config():
    assert model_max_len(SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=128000))) == 128000
    assert model_max_len(SimpleNamespace(max_position_embeddings=32768)) == 32768
    assert model_max_len(SimpleNamespace()) is None


def test_the_bound_holds_for_a_real_prompt_at_the_data_limits(tiny_any_dir):
    """The tiny model's own processor (Qwen3-VL's timestamps included) never makes a prompt longer than the bound."""
    from streamgrpo.data.prompts import processor_inputs, vision_factors
    from streamgrpo.models.loading import load_processor
    from streamgrpo.wire import Visual

    proc = load_processor(str(tiny_any_dir))
    factor, temporal = vision_factors(proc)
    frames, side = 16, 2 * factor
    question = "Which colour is the square that moves from left to right? (A) red (B) green (C) blue"
    cfg = build_config({}, [f"data.max_frames={frames}", f"data.max_pixels={side * side}", "data.min_pixels=784",
                            "rollout.max_completion_length=64"])
    shape = record_shape([(1, 0)], [len(question)], data=cfg.data, rollout=cfg.rollout, factor=factor,
                         temporal_patch=temporal)
    video = np.zeros((frames, side, side, 3), dtype=np.uint8)
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inputs = processor_inputs(proc, text, [Visual("video", video, 2.0, np.arange(frames, dtype=np.int32))])
    real = int(inputs["input_ids"].shape[-1])
    visual = (frames // temporal) * (side // factor) ** 2
    assert real > visual  # the video is in the prompt at full size
    assert real <= prompt_tokens(shape)
    assert prompt_tokens(shape) - real <= TEMPLATE_TOKENS + frames // temporal * TOKENS_PER_FRAME_GROUP + len(question)


@pytest.mark.parametrize("frames", [1, 3])
def test_odd_frame_counts_round_up_to_a_whole_group(frames):
    s = _long(max_frames=frames)
    assert prompt_tokens(s) >= 128 * ((frames + 1) // 2)
