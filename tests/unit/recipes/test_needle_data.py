"""The needle data set (streamgrpo/recipes/needle): the flash is in the frames the record names and nowhere
else, cutting removes exactly those frames, the records and files are what the recipe promises."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streamgrpo.recipes.demo.data import COLOURS
from streamgrpo.recipes.needle.data import NEEDLE_LENGTHS, cut_needle, make_needle, needle_spec, render_needle


def _coloured(frames_THWC: np.ndarray, tol: int = 0) -> np.ndarray:
    """Per frame: does any pixel have colour (channels differ by more than ``tol``)?"""
    f = frames_THWC.astype(np.int32)
    return (f.max(-1) - f.min(-1) > tol).reshape(len(f), -1).any(1)


def test_the_flash_is_in_the_frames_the_spec_names_and_nowhere_else():
    rng = np.random.default_rng(3)
    starts = set()
    for _ in range(24):
        spec = needle_spec(rng, frames=256, size=28)
        video = render_needle(spec)
        assert video.shape == (256, 28, 28, 3) and video.dtype == np.uint8
        assert spec.length in NEEDLE_LENGTHS and 0 <= spec.start <= 256 - spec.length
        assert np.flatnonzero(_coloured(video)).tolist() == list(spec.needle_frames)
        colour = np.array(COLOURS[spec.colour], dtype=np.uint8)
        for t in spec.needle_frames:  # the needle's own colour, over a third of the frame
            assert (video[t] == colour).all(-1).mean() > 0.3
        starts.add(spec.start // 64)
    assert starts == {0, 1, 2, 3}  # the flash lands anywhere in the video


def test_cutting_removes_exactly_the_needle_frames():
    spec = needle_spec(np.random.default_rng(0), frames=64, size=16)
    video = render_needle(spec)
    cut = cut_needle(video, spec)
    assert len(cut) == 64 - spec.length and not _coloured(cut).any()
    kept = [t for t in range(64) if t not in spec.needle_frames]
    assert np.array_equal(cut, video[kept])  # every other frame unchanged, in order


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="even size"):
        needle_spec(np.random.default_rng(0), frames=256, size=27)


def test_make_needle_writes_videos_whose_flash_is_where_the_record_says(tmp_path):
    import av

    root = make_needle(tmp_path / "d", n=12, seed=5, frames=64, size=28)
    train = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (root / "test.jsonl").read_text().splitlines()]
    cut = [json.loads(line) for line in (root / "test_cut.jsonl").read_text().splitlines()]
    assert len(train) == 12 and len(test) == len(cut) == 10
    assert {r["meta"]["kind"] for r in train + test} == {"needle"}
    assert len({r["video"] for r in train + test}) == 22  # a video per record: nothing shared across splits
    for rec, twin in zip(test, cut):
        assert twin["conversations"] == rec["conversations"] and twin["meta"]["needle"] is None
        with av.open(str(root / rec["video"])) as c:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        with av.open(str(root / twin["video"])) as c:
            cut_frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        first, end = rec["meta"]["needle"]
        assert len(frames) == 64 and len(cut_frames) == 64 - (end - first)
        # after lossy encoding: strongly coloured pixels only in the needle's frames, none in the cut video
        assert np.flatnonzero(_coloured(frames, tol=60)).tolist() == list(range(first, end))
        assert not _coloured(cut_frames, tol=60).any()
        colour = rec["meta"]["colour"]
        assert f"({'ABC'[list(COLOURS).index(colour)]}) {colour}" in rec["conversations"][1]["value"]
    again = make_needle(tmp_path / "e", n=12, seed=5, frames=64, size=28)  # same seed, same records
    assert (again / "train.jsonl").read_text() == (root / "train.jsonl").read_text()


def test_the_demo_recipe_makes_the_needle_set_when_its_config_asks(tmp_path):
    from streamgrpo.recipes.demo.config import DemoConfig
    from streamgrpo.recipes.demo.tasks import prepare_data

    demo = DemoConfig(task="needle", make_data=True, size=10, frames=16)
    train = tmp_path / "needle" / "train.jsonl"
    assert prepare_data(demo, train) and not prepare_data(demo, train)  # made once, then left alone
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 10 and {r["meta"]["kind"] for r in rows} == {"needle"}
    assert (tmp_path / "needle" / "test_cut.jsonl").exists()
    assert not prepare_data(DemoConfig(task="needle", size=10), tmp_path / "off" / "train.jsonl")  # make_data off
