"""Shuffled frames: really permuted, deterministic per seed, each video on its own, images untouched;
the eval probe's per-record shuffle as the processor receives it (tiny model's processor, demo videos)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from streamgrpo.data.shuffle import has_video, shuffle_visuals, shuffled_order
from streamgrpo.wire import Visual


def _video(t: int, base: int) -> Visual:
    frames = np.stack([np.full((4, 4, 3), base + i, np.uint8) for i in range(t)])
    return Visual("video", frames, 2.0, np.arange(10, 10 + t, dtype=np.int32))


def test_order_is_a_non_identity_permutation_for_two_or_more():
    rng = np.random.default_rng(0)
    for n in (2, 3, 8):
        for _ in range(50):
            order = shuffled_order(n, rng)
            assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))
    assert shuffled_order(1, rng).tolist() == [0] and shuffled_order(0, rng).tolist() == []


def test_frames_are_permuted_within_each_video_and_images_kept():
    image = Visual("image", np.zeros((1, 4, 4, 3), np.uint8))
    visuals = [_video(8, 0), image, _video(4, 100)]
    out = shuffle_visuals(visuals, np.random.default_rng(7))
    assert out[1] is image
    for before, after in ((visuals[0], out[0]), (visuals[2], out[2])):
        firsts = after.frames[:, 0, 0, 0].tolist()
        assert sorted(firsts) == before.frames[:, 0, 0, 0].tolist() and firsts != sorted(firsts)  # same frames, new order
        assert after.frame_indices.tolist() == before.frame_indices.tolist()  # position labels keep their order
        assert after.fps == before.fps
    assert visuals[0].frames[:, 0, 0, 0].tolist() == list(range(8))  # inputs untouched
    again = shuffle_visuals(visuals, np.random.default_rng(7))
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(out, again))  # deterministic per seed
    other = shuffle_visuals(visuals, np.random.default_rng(8))
    assert not np.array_equal(other[0].frames, out[0].frames)
    assert has_video(visuals) and not has_video([image]) and not has_video([_video(1, 0)])


# ------------------------------------------------- the eval probe's per-record shuffle (real processor)
def _policy(tiny_model_dir):
    """The parts of a Policy that building a request uses: the tiny model's real processor (no engine)."""
    from streamgrpo.data.prompts import vision_factors
    from streamgrpo.evaluator.answering import Policy
    from streamgrpo.models.loading import load_processor

    processor = load_processor(str(tiny_model_dir))
    return Policy(None, processor, *vision_factors(processor), name="tiny")


def _records(demo_data_dir, name="test.jsonl"):
    from streamgrpo.commands.infer import read_input_records
    from streamgrpo.config import load_config

    cfg = load_config("demo", ["data.kinds=null", f"data.media_root={demo_data_dir}"])
    records, errors, _ = read_input_records(demo_data_dir / name, cfg.data)
    assert not errors and records
    return records, cfg.data


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))


def _order(ordered: np.ndarray, shuffled: np.ndarray) -> list[int]:
    """Which ordered frame each shuffled frame is (asserts every one is one of them, each once)."""
    order = [next(j for j in range(len(ordered)) if np.array_equal(f, ordered[j])) for f in shuffled]
    assert sorted(order) == list(range(len(ordered)))
    return order


def test_record_rng_is_stable_per_seed_and_id_across_processes():
    from streamgrpo.config import ConfigError
    from streamgrpo.evaluator.answering import record_rng

    def draw(seed, rid):
        return record_rng(seed, rid).integers(0, 2**32, 4).tolist()

    assert draw(0, "test-00003") == draw(0, "test-00003")
    assert draw(1, "test-00003") != draw(0, "test-00003") and draw(0, "test-00004") != draw(0, "test-00003")
    code = "from streamgrpo.evaluator.answering import record_rng; print(record_rng(7, 'r-1').integers(0, 2**32, 4).tolist())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout.strip() for h in ("1", "2")}
    assert outs == {str(draw(7, "r-1"))}  # not Python's salted hash(): the same in every process
    with pytest.raises(ConfigError, match="shuffle-seed"):
        record_rng(-1, "r-1")


def test_shuffled_request_gives_the_processor_shuffled_video_frames(tiny_model_dir, demo_data_dir):
    from streamgrpo.evaluator.answering import prepare_request

    policy = _policy(tiny_model_dir)
    records, data_cfg = _records(demo_data_dir)
    rec = next(r for r in records if r.kind == "direction")
    ordered = prepare_request(policy, rec, data_cfg)
    shuffled = prepare_request(policy, rec, data_cfg, shuffle_seed=0)
    (vo,), (vs,) = ordered.visuals, shuffled.visuals
    assert vo.frames.shape[0] == 8
    order = _order(vo.frames, vs.frames)
    assert order != list(range(8))  # the same frames, in another order
    assert np.array_equal(vs.frame_indices, vo.frame_indices)  # ascending labels: no timestamp tells the order
    assert shuffled.prompt_text == ordered.prompt_text
    assert torch_equal(shuffled.inputs["input_ids"], ordered.inputs["input_ids"])
    assert torch_equal(shuffled.inputs["video_grid_thw"], ordered.inputs["video_grid_thw"])
    pix_o, pix_s = ordered.inputs["pixel_values_videos"], shuffled.inputs["pixel_values_videos"]
    assert pix_o.shape == pix_s.shape and not torch_equal(pix_o, pix_s)  # what the model sees changed

    # deterministic per (seed, id), whatever was prepared before; another seed, another order
    for other in records[:3]:
        prepare_request(policy, other, data_cfg, shuffle_seed=0)
    again = prepare_request(policy, rec, data_cfg, shuffle_seed=0)
    assert torch_equal(again.inputs["pixel_values_videos"], pix_s)
    assert _order(vo.frames, prepare_request(policy, rec, data_cfg, shuffle_seed=1).visuals[0].frames) != order


def test_shuffled_request_leaves_an_image_record_as_it_is(tiny_model_dir, demo_data_dir):
    from streamgrpo.evaluator.answering import prepare_request

    policy = _policy(tiny_model_dir)
    records, data_cfg = _records(demo_data_dir, "test_image.jsonl")
    ordered = prepare_request(policy, records[0], data_cfg)
    shuffled = prepare_request(policy, records[0], data_cfg, shuffle_seed=0)
    assert [v.kind for v in shuffled.visuals] == ["image"]
    assert np.array_equal(shuffled.visuals[0].frames, ordered.visuals[0].frames)
    assert set(shuffled.inputs) == set(ordered.inputs) and "pixel_values" in shuffled.inputs
    assert all(torch_equal(shuffled.inputs[k], ordered.inputs[k]) for k in ordered.inputs)


def test_multi_video_record_shuffles_each_video_on_its_own(tiny_model_dir, demo_data_dir):
    from streamgrpo.evaluator.answering import prepare_request

    policy = _policy(tiny_model_dir)
    records, data_cfg = _records(demo_data_dir)
    rec = next(r for r in records if r.kind == "multi_video")
    ordered = prepare_request(policy, rec, data_cfg)
    assert len(ordered.visuals) >= 2

    def orders(seed):
        shuffled = prepare_request(policy, rec, data_cfg, shuffle_seed=seed)
        assert len(shuffled.visuals) == len(ordered.visuals)
        # each video's frames come from that video only, in a new order
        out = [_order(vo.frames, vs.frames) for vo, vs in zip(ordered.visuals, shuffled.visuals)]
        assert all(o != list(range(len(o))) for o in out)
        return out

    # one permutation per video, not one shared: for some seed the videos' orders differ
    assert any(len({tuple(o) for o in orders(seed)}) > 1 for seed in range(4))
