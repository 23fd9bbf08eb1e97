"""Prompts and processor inputs through the real tiny Qwen2.5-VL / Qwen3-VL processors and models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamgrpo.config import DataConfig
from streamgrpo.data.prompts import (
    build_messages,
    build_prompt_text,
    instruction,
    processor_inputs,
    user_content,
    vision_factors,
)
from streamgrpo.data.records import Record, load_records
from streamgrpo.data.video import load_visuals
from streamgrpo.wire import Visual


def _processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def test_instructions_and_tags():
    think = instruction(DataConfig())
    assert "<think> </think>" in think and "<answer> </answer>" in think
    reasoning = instruction(DataConfig(think_tag="reasoning"))
    assert "<reasoning>" in reasoning and "<think>" not in reasoning
    no_think = instruction(DataConfig(prompt_format="no_think"))
    assert "<answer> </answer>" in no_think and "think" not in no_think


def test_user_content_keeps_placeholder_order():
    content = user_content("<video>\nFirst <image> then <video>\nwhich?", "Say it.")
    assert content == [{"type": "video"}, {"type": "text", "text": "First"}, {"type": "image"},
                       {"type": "text", "text": "then"}, {"type": "video"}, {"type": "text", "text": "which? Say it."}]
    assert user_content("Q <video>", "") == [{"type": "text", "text": "Q"}, {"type": "video"}]
    rec = Record("r", "<video> Q", "A", "A")
    msgs = build_messages(rec, DataConfig(system_prompt="Be brief."))
    assert msgs[0] == {"role": "system", "content": "Be brief."} and msgs[1]["role"] == "user"


def _eight_video_record(demo_dir) -> Record:
    vids = sorted(str(p) for p in (demo_dir / "videos").glob("*.mp4"))[:8]
    img = str(sorted((demo_dir / "images").glob("*.png"))[0])
    q = "<video>" * 3 + "\n<image>\n" + "<video>" * 5 + "\nWhich video shows a red square? (1) (2) (3) (4) (5) (6) (7) (8)"
    return Record("eight", q, "(2)", "<answer>(2)</answer>", videos=vids, images=[img])


def test_eight_videos_through_processor_and_model(tiny_any_dir, demo_data_dir):
    from transformers import AutoModelForImageTextToText

    processor = _processor(tiny_any_dir)
    factor, tp = vision_factors(processor)
    vp = processor.video_processor
    assert factor == vp.patch_size * vp.merge_size and tp == vp.temporal_patch_size
    cfg = DataConfig(min_frames=4, max_frames=8)
    rec = _eight_video_record(demo_data_dir)
    visuals = load_visuals(rec, cfg, factor=factor, temporal_patch=tp)
    assert [v.kind for v in visuals] == ["video"] * 3 + ["image"] + ["video"] * 5
    text = build_prompt_text(processor, rec, cfg)
    assert text.count("<|video_pad|>") == 8 and text.count("<|image_pad|>") == 1
    assert text.index("<|image_pad|>") > text.index("<|video_pad|>")
    assert "<answer> </answer>" in text and text.rstrip().endswith("assistant")
    inputs = processor_inputs(processor, text, visuals)
    again = processor_inputs(processor, text, [Visual(v.kind, v.frames.copy(), v.fps, v.frame_indices.copy())
                                               for v in visuals])
    assert set(inputs.keys()) == set(again.keys())
    for key in inputs:
        assert torch.equal(inputs[key], again[key]) if torch.is_tensor(inputs[key]) else inputs[key] == again[key]
    assert "mm_token_type_ids" in inputs
    # the processor did not resize: its grid is our frames divided by the patch
    grid = inputs["video_grid_thw"]
    assert grid.shape == (8, 3)
    videos = [v for v in visuals if v.kind == "video"]
    for (t, h, w), v in zip(grid.tolist(), videos):
        assert (t, h, w) == (v.frames.shape[0] // tp, v.frames.shape[1] // vp.patch_size,
                             v.frames.shape[2] // vp.patch_size)
    assert inputs["image_grid_thw"].tolist() == [[1, visuals[3].frames.shape[1] // vp.patch_size,
                                                  visuals[3].frames.shape[2] // vp.patch_size]]
    n_video_tokens = int((inputs["input_ids"] == processor.video_token_id).sum())
    assert n_video_tokens == int(grid.prod(-1).sum()) // vp.merge_size**2
    if "second_per_grid_ts" in inputs:  # Qwen2.5-VL: temporal patch / sampled fps (4 of 8 frames at 4 fps)
        assert torch.as_tensor(inputs["second_per_grid_ts"]).tolist() == pytest.approx([1.0] * 8)
    else:  # Qwen3-VL: timestamps from the source fps and indices
        decoded = processor.tokenizer.decode(inputs["input_ids"][0])
        assert "<0.2 seconds>" in decoded and "<1.5 seconds>" in decoded  # frames 0,2 | 5,7 at 4 fps
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_any_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(out.logits).all()


def test_demo_records_both_formats(tiny_model_dir, demo_data_dir):
    processor = _processor(tiny_model_dir)
    factor, tp = vision_factors(processor)
    for name in ("train.jsonl", "train_image.jsonl"):
        cfg = DataConfig(prompt_format="no_think", min_frames=8, max_frames=8)
        for rec in load_records(demo_data_dir / name, cfg)[:6]:
            visuals = load_visuals(rec, cfg, factor=factor, temporal_patch=tp)
            text = build_prompt_text(processor, rec, cfg)
            assert "<think>" not in text.split("assistant")[0].split("user")[-1]
            inputs = processor_inputs(processor, text, visuals)
            assert inputs["input_ids"].shape[0] == 1
            assert ("pixel_values_videos" in inputs) == bool(rec.videos)
            assert ("pixel_values" in inputs) == bool(rec.images)


def test_processor_inputs_rejects_bad_visuals(tiny_model_dir):
    processor = _processor(tiny_model_dir)
    rec = Record("r", "<video> Q", "A", "A", videos=["x"])
    text = build_prompt_text(processor, rec, DataConfig())
    odd = Visual("video", np.zeros((2, 50, 56, 3), np.uint8), 4.0, np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="multiples of 28"):
        processor_inputs(processor, text, [odd])
    with pytest.raises(ValueError, match="1 video and 0 image blocks but 0 videos and 1 images"):
        processor_inputs(processor, text, [Visual("image", np.zeros((1, 56, 56, 3), np.uint8))])


def test_learner_recreates_identical_inputs_from_the_wire(tiny_qwen3_dir, demo_data_dir):
    """Generator side -> msgpack ScoredGroup -> learner side: same input_ids and pixel values, with the
    frames inline and by reference (a path relative to data.media_root: a file outside the root would
    travel inline, the learner refusing any path outside its root)."""
    from streamgrpo import wire
    from streamgrpo.learner.intake.media import MediaResolver

    processor = _processor(tiny_qwen3_dir)
    factor, tp = vision_factors(processor)
    cfg = DataConfig(media_root=str(demo_data_dir))
    rec = _eight_video_record(demo_data_dir)
    visuals = load_visuals(rec, cfg, factor=factor, temporal_patch=tp)
    text = build_prompt_text(processor, rec, cfg)
    gen = processor_inputs(processor, text, visuals)
    done = wire.Completion(np.array([1, 2], np.int32), np.zeros(2, np.float32), "x", "stop", {"accuracy": 0.0}, 0.0)
    group = wire.ScoredGroup("eight", "g0", 0, "tiny", gen["input_ids"][0].numpy().astype(np.int32), visuals,
                             rec.answer, [done], prompt_text=text)
    by_ref = wire.decode(wire.encode(group))
    assert all(v.frames is None and not Path(v.ref.path).is_absolute() for v in by_ref.visuals)
    for back in (wire.decode(wire.encode(wire.inline(group))), MediaResolver(cfg).resolve(by_ref)):
        _same_inputs(processor, back, gen)


def _same_inputs(processor, back, gen) -> None:
    learn = processor_inputs(processor, back.prompt_text, back.visuals)
    assert np.array_equal(learn["input_ids"][0].numpy(), back.prompt_ids)
    for key in ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(gen[key], learn[key]), key
