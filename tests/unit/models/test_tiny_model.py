"""Tiny model kit: builds offline, reloads with plain transformers, runs a video forward + sampling."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch


def _video(size: int, frames: int = 8) -> np.ndarray:
    """A moving red square on grey, T x H x W x 3 uint8."""
    v = np.full((frames, size, size, 3), 128, dtype=np.uint8)
    for t in range(frames):
        x = t * (size - 14) // max(frames - 1, 1)
        v[t, 20:34, x : x + 14] = (220, 30, 30)
    return v


def _inputs(proc, arch):
    size = 56 if arch == "qwen2_5_vl" else 64
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour? (A) red (B) green"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    kwargs = {"do_sample_frames": False, "fps": 2.0}
    if arch == "qwen3_vl":
        kwargs = {"do_sample_frames": False,
                  "video_metadata": [{"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8}]}
    return proc(text=[text], videos=[_video(size)], return_tensors="pt", videos_kwargs=kwargs)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_tiny_builds_reloads_and_generates_with_video(arch, request):
    from transformers import AutoModelForImageTextToText, AutoProcessor


    d = request.getfixturevalue("tiny_model_dir" if arch == "qwen2_5_vl" else "tiny_qwen3_dir")
    proc = AutoProcessor.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d)
    assert model.config.model_type == arch
    assert count_parameters(model) < 2_000_000
    tok = proc.tokenizer
    for t in ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>",
              "<think>", "</think>", "<answer>", "</answer>"]:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t} is not a single token: {ids}"
    inp = _inputs(proc, arch)
    n_video_tokens = int((inp["input_ids"] == model.config.video_token_id).sum())
    assert n_video_tokens == 16  # 8 frames / temporal 2 * (2x2 merged patches)
    with torch.no_grad():
        out = model(**inp)
    assert out.logits.shape[:2] == inp["input_ids"].shape
    assert torch.isfinite(out.logits).all()
    torch.manual_seed(0)
    gen = model.generate(**inp, do_sample=True, num_return_sequences=4, max_new_tokens=6)
    assert gen.shape[0] == 4 and gen.shape[1] > inp["input_ids"].shape[1]


def _digest(d):
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.suffix in (".safetensors", ".json", ".jinja"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_different_seed_different_weights(tmp_path):
    from streamgrpo.models.tiny import build_tiny

    a = build_tiny(tmp_path / "a", seed=3)
    b = build_tiny(tmp_path / "b", seed=3)
    c = build_tiny(tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_unknown_arch_is_an_error(tmp_path):
    from streamgrpo.models.tiny import build_tiny

    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny(tmp_path, arch="llama")


def test_cli_model_tiny(tmp_path):
    from streamgrpo.cli import main

    assert main(["model", "tiny", "--out", str(tmp_path / "m"), "--arch", "qwen2_5_vl"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_cli_model_tiny_warms_on_the_prompts_of_its_config(tmp_path):
    from streamgrpo.cli import main

    data = tmp_path / "motion" / "train.jsonl"
    assert main(["model", "tiny", "--out", str(tmp_path / "m"), "--warm-format", "--warm-steps", "2",
                 "--config", "demo-motion", "--set", f"data.train_path={data}", "--set", "demo.size=20"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    videos = list((tmp_path / "motion" / "videos").glob("*.mp4"))  # the config's data set, made on the way
    assert videos and all(v.stem.endswith("r") for v in videos)  # demo_motion: reverse


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
