"""Frame sampling and sizing rules, decoding (decord vs PyAV), load_visuals, bad media, the iterator.

Real mp4/PNG files from the demo generator; the reference rules are the ones shipped in
transformers (Qwen2-VL smart_resize, Qwen2-VL/Qwen3-VL video processors' frame sampling).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamgrpo.config import DataConfig
from streamgrpo.data import decode
from streamgrpo.data.dataset import epoch_order, iter_samples, shard_records
from streamgrpo.data.records import DataError, Record, load_records
from streamgrpo.data.sampling import (
    BudgetError,
    MediaSpec,
    dynamic_nframes,
    evenly_spaced_indices,
    plan_sizes,
    sample_pixels,
    smart_nframes,
)
from streamgrpo.data.video import load_visuals, sample_frame_indices, smart_resize
from streamgrpo.metrics import ERRORS
from streamgrpo.recipes.demo.data import render, write_mp4


# ------------------------------------------------------------------------------ pure rules
@settings(max_examples=300, deadline=None)
@given(
    h=st.integers(32, 4000), w=st.integers(32, 4000), factor=st.sampled_from([28, 32]),
    lo=st.integers(4, 256), hi=st.integers(256, 16384),
)
def test_smart_resize_matches_qwen(h, w, factor, lo, hi):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as qwen_smart_resize

    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError):
            smart_resize(h, w, factor, lo * factor * factor, hi * factor * factor)
        return
    got = smart_resize(h, w, factor, lo * factor * factor, hi * factor * factor)
    assert got == qwen_smart_resize(h, w, factor, lo * factor * factor, hi * factor * factor)
    rh, rw = got
    assert rh % factor == 0 and rw % factor == 0
    assert rh * rw <= hi * factor * factor or rh * rw >= lo * factor * factor  # min wins only when upscaling


def test_smart_resize_examples():
    assert smart_resize(56, 56, 28, 4 * 784, 768 * 784) == (56, 56)
    assert smart_resize(56, 56, 32, 4 * 1024, 256 * 1024) == (64, 64)  # rounds up to 2x2 patches of 32
    assert smart_resize(1080, 1920, 28, 4 * 784, 768 * 784) == (560, 1008)  # max wins, floor to 28
    assert smart_resize(20, 30, 28, 4 * 784, 768 * 784) == (56, 84)  # min: ceil to 28 (aspect kept)
    assert smart_resize(10, 10, 28, 4 * 784, 4 * 784) == (56, 56)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(2, 3000), video_fps=st.sampled_from([4.0, 12.5, 24.0, 29.97, 30.0, 60.0]),
       fps=st.sampled_from([0.5, 1.0, 2.0, 4.0]), lo=st.sampled_from([2, 4, 8, 16]), hi=st.integers(2, 800))
def test_frame_count_matches_qwen_processor(total, video_fps, fps, lo, hi):
    """Even min_frames (where qwen-vl-utils and the transformers processor agree)."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    if lo > hi:
        return
    ours = smart_nframes(total, video_fps, fps, lo, hi, 2)
    ref = Qwen2VLVideoProcessor().sample_frames(
        VideoMetadata(total_num_frames=total, fps=video_fps), temporal_patch_size=2, min_frames=lo, max_frames=hi, fps=fps
    )
    assert ours == int((ref < total).sum())  # (its float arange can add an out-of-range index)
    assert ours % 2 == 0 and 2 <= ours <= total


@pytest.mark.parametrize("total,n", [(8, 4), (8, 8), (300, 20), (1, 2), (3, 4), (1000, 768)])
def test_indices_match_qwen3_processor(total, n):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ref = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=total, fps=30.0), num_frames=n)
    idx = evenly_spaced_indices(total, n)
    assert idx == [int(i) for i in ref]
    assert idx[-1] == total - 1 and len(idx) == n


def test_sample_frame_indices_rules():
    assert sample_frame_indices(8, 4.0) == [0, 2, 5, 7]  # 2 s at fps 2 -> 4 frames
    assert len(sample_frame_indices(300, 30.0, fps=2.0)) == 20
    assert len(sample_frame_indices(300, 30.0, fps=2.0, max_frames=7)) == 6  # floor to the temporal patch
    assert len(sample_frame_indices(30, 30.0, fps=2.0, min_frames=3)) == 4  # min ceil'd to 4 (qwen-vl-utils)
    assert len(sample_frame_indices(3000, 30.0, fps=2.0, max_frames=768)) == 200
    assert sample_frame_indices(1, 30.0) == [0, 0]  # a still video: one temporal patch, repeated
    assert len(sample_frame_indices(90, 30.0, fps=1.0, temporal_patch=4, min_frames=4)) == 4
    with pytest.raises(ValueError):
        sample_frame_indices(0, 30.0)


def test_dynamic_nframes():
    assert dynamic_nframes(15, 4, 8) == 8
    assert dynamic_nframes(11, 4, 16) == 10
    assert dynamic_nframes(5, 4, 8) == 4
    assert dynamic_nframes(2, 4, 8) == 4  # the bound; load_visuals then caps it at the video length
    assert dynamic_nframes(1000, 4, 768) == 768


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.sampled_from(["video", "image"]), st.integers(16, 2000), st.integers(16, 2000),
                             st.integers(1, 64)), min_size=1, max_size=10),
    budget_cells=st.integers(1, 4000),
)
def test_plan_sizes_budget_holds(sizes, budget_cells):
    specs = [MediaSpec(k, h, w, 2 * n if k == "video" else 1) for k, h, w, n in sizes
             if max(h, w) / min(h, w) <= 200]
    if not specs:
        return
    budget = budget_cells * 28 * 28
    try:
        plans = plan_sizes(specs, factor=28, min_pixels=4 * 784, max_pixels=768 * 784, total_pixels=budget,
                           min_frames=4)
    except BudgetError:
        smallest = [np.prod(smart_resize(s.height, s.width, 28, 784, 784)) for s in specs]
        assert sum((2 if s.kind == "video" else 1) * a for s, a in zip(specs, smallest)) > budget  # impossible
        return
    assert sample_pixels(plans) <= budget
    for s, p in zip(specs, plans):
        assert p.height % 28 == 0 and p.width % 28 == 0
        assert p.nframes % 2 == 0 if s.kind == "video" else p.nframes == 1
        assert p.nframes <= s.nframes


def test_plan_sizes_concessions_in_order():
    spec = [MediaSpec("video", 224, 224, 16)] * 2
    full = plan_sizes(spec, factor=28, min_pixels=784, max_pixels=224 * 224, total_pixels=10**9)
    assert [(p.nframes, p.height) for p in full] == [(16, 224), (16, 224)]
    # (1) smaller frames, same counts
    mid = plan_sizes(spec, factor=28, min_pixels=56 * 56, max_pixels=224 * 224, total_pixels=32 * 112 * 112)
    assert [(p.nframes, p.height, p.width) for p in mid] == [(16, 112, 112)] * 2
    # (2) frames drop to min_frames once frames reach min_pixels
    low = plan_sizes(spec, factor=28, min_pixels=56 * 56, max_pixels=224 * 224, total_pixels=8 * 56 * 56,
                     min_frames=4)
    assert [(p.nframes, p.height) for p in low] == [(4, 56), (4, 56)]
    assert sample_pixels(low) <= 8 * 56 * 56
    with pytest.raises(BudgetError, match="total_pixels"):
        plan_sizes(spec, factor=28, min_pixels=784, max_pixels=224 * 224, total_pixels=3 * 784)


# ------------------------------------------------------------------------------ helpers
def _cfg(**kw) -> DataConfig:
    kw.setdefault("frame_cache_mib", 0)
    return DataConfig(**kw)


def _record(rid: str, videos=(), images=(), meta=None, question=None) -> Record:
    q = question if question is not None else "<video>" * len(videos) + "<image>" * len(images) + " What?"
    return Record(id=rid, question=q, answer="A", solution="<answer>A</answer>", videos=[str(v) for v in videos],
                  images=[str(i) for i in images], meta=meta or {}, kind=None)


def _videos(demo_dir: Path) -> list[Path]:
    return sorted((demo_dir / "videos").glob("*.mp4"))


# ------------------------------------------------------------------------------ load_visuals
def test_load_visuals_fps_and_meta(demo_data_dir):
    v = _videos(demo_data_dir)[0]
    (vis,) = load_visuals(_record("r", [v]), _cfg(), factor=28)
    assert vis.kind == "video" and vis.frames.dtype == np.uint8
    assert vis.frames.shape == (4, 56, 56, 3)  # 8 frames at 4 fps, sampled at 2 fps
    assert vis.fps == pytest.approx(4.0)
    assert vis.frame_indices.dtype == np.int32 and list(vis.frame_indices) == [0, 2, 5, 7]
    (vis,) = load_visuals(_record("r", [v], meta={"min_frames": 8, "max_frames": 8}), _cfg(), factor=28)
    assert vis.frames.shape[0] == 8 and list(vis.frame_indices) == list(range(8))
    (vis,) = load_visuals(_record("r", [v], meta={"fps": 1.0}), _cfg(min_frames=2), factor=28)
    assert vis.frames.shape[0] == 2
    (vis,) = load_visuals(_record("r", [v]), _cfg(), factor=32)  # Qwen3-VL grid: 56 -> 64
    assert vis.frames.shape[1:3] == (64, 64)
    # pixel bounds: min_pixels upsamples to a multiple of the factor, max_pixels caps
    (vis,) = load_visuals(_record("r", [v]), _cfg(min_pixels=112 * 112, max_pixels=112 * 112), factor=28)
    assert vis.frames.shape[1:3] == (112, 112)
    (vis,) = load_visuals(_record("r", [v], meta={"max_pixels": 28 * 28, "min_pixels": 28 * 28}), _cfg(), factor=28)
    assert vis.frames.shape[1:3] == (28, 28)


def test_load_visuals_dynamic_sample(demo_data_dir, tmp_path):
    long = tmp_path / "long.mp4"
    write_mp4(long, np.concatenate([render("red", "right", 0, 56, 8)] * 5), fps=4)  # 40 frames, 10 s
    cfg = _cfg(min_frames=4, max_frames=16)
    (fps_vis,) = load_visuals(_record("r", [long]), cfg, factor=28)
    assert fps_vis.frames.shape[0] == 16  # 10 s at 2 fps = 20, capped at 16
    (dyn,) = load_visuals(_record("r", [long], meta={"dynamic_sample": True, "max_frames": 32}), cfg, factor=28)
    assert dyn.frames.shape[0] == 32  # from the length (40), not the fps
    short = _videos(demo_data_dir)[0]
    recs = _record("r", [long, short], meta={"dynamic_sample": True, "frame_cnts": [11, 8]})
    a, b = load_visuals(recs, cfg, factor=28)
    assert a.frames.shape[0] == 10 and b.frames.shape[0] == 8  # frame_cnts 11 -> 10 (patch), 8 -> 8
    assert int(a.frame_indices[-1]) == 39  # spread over the whole file


def test_load_visuals_order_and_budget_with_8_videos(demo_data_dir):
    vids = _videos(demo_data_dir)[:8]
    img = sorted((demo_data_dir / "images").glob("*.png"))[0]
    q = "<video>" * 4 + "<image>" + "<video>" * 4 + " Which?"
    rec = _record("eight", vids, [img], question=q)
    vis = load_visuals(rec, _cfg(min_frames=8, max_frames=8), factor=28)
    assert [v.kind for v in vis] == ["video"] * 4 + ["image"] + ["video"] * 4
    assert vis[4].frames.shape == (1, 56, 56, 3)
    ref = decode.decode_all(str(vids[5]))
    assert np.array_equal(vis[6].frames, ref)  # placeholder order kept, untouched at native size
    budget = 40 * 28 * 28
    small = load_visuals(rec, _cfg(min_frames=8, max_frames=8, min_pixels=784, total_pixels=budget), factor=28)
    used = sum(v.frames.shape[0] * v.frames.shape[1] * v.frames.shape[2] for v in small)
    assert used <= budget
    assert all(v.frames.shape[0] % 2 == 0 for v in small if v.kind == "video")


def test_budget_error_names_record(demo_data_dir):
    vids = _videos(demo_data_dir)[:4]
    with pytest.raises(DataError, match="'tight'") as info:
        load_visuals(_record("tight", vids), _cfg(min_pixels=784, total_pixels=784 * 4), factor=28)
    assert info.value.kind == "budget"


def test_images_use_the_same_resize_rule(demo_data_dir, tmp_path):
    from PIL import Image

    p = tmp_path / "wide.png"
    Image.fromarray(np.full((100, 300, 3), 200, np.uint8)).save(p)
    (vis,) = load_visuals(_record("img", images=[p]), _cfg(), factor=28)
    assert vis.kind == "image" and vis.frames.shape == (1, *smart_resize(100, 300, 28, 4 * 784, 768 * 784), 3)
    assert vis.fps == 0.0 and vis.frame_indices.size == 0


# ------------------------------------------------------------------------------ decoders
def _write_bframes(path: Path, frames: np.ndarray, codec: str = "libx264") -> None:
    """An mp4 with B-frames (decode order != display order) and a key frame every 10 frames."""
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=25)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.codec_context.gop_size = 10
        s.codec_context.max_b_frames = 2
        if codec == "libx264":
            s.codec_context.options = {"preset": "medium", "bf": "2", "threads": "1"}
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


def test_decord_and_pyav_give_the_same_frames(demo_data_dir, tmp_path):
    long = tmp_path / "gop.mp4"
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 255, (60, 8, 8, 3), dtype=np.uint8), 8, axis=1).repeat(8, axis=2)
    write_mp4(long, frames, fps=30, gop=12)  # 5 key frames: the PyAV reader must seek
    bfr, mp4v = tmp_path / "bframes.mp4", tmp_path / "mpeg4.mp4"
    _write_bframes(bfr, frames[:40])
    _write_bframes(mp4v, frames[:40], codec="mpeg4")
    cases = [(_videos(demo_data_dir)[3], [0, 2, 5, 7]), (long, [0, 7, 13, 30, 31, 59]), (long, [59, 3, 3]),
             (bfr, [1, 2, 9, 10, 11, 25, 38, 39]), (bfr, [12, 21, 33])]
    # MPEG-4 part 2 with B-frames: decord seeks to the wrong frames (off by the B-frame delay), so
    # `auto` reads it with PyAV, which must match a full decode.
    auto = decode.open_video(str(mp4v), "auto")
    assert isinstance(auto, decode.PyAVReader)
    assert np.array_equal(auto.read([0, 5, 12, 21, 33, 39]), decode.decode_all(str(mp4v))[[0, 5, 12, 21, 33, 39]])
    auto.close()
    for path, idx in cases:
        d = decode.open_video(str(path), "decord")
        p = decode.open_video(str(path), "pyav")
        assert d.info.total_frames == p.info.total_frames
        assert (d.info.height, d.info.width) == (p.info.height, p.info.width)
        a, b = d.read(idx), p.read(idx)
        d.close()
        p.close()
        assert a.shape == b.shape == (len(idx), d.info.height, d.info.width, 3)
        assert np.array_equal(a, b)
        assert np.array_equal(b, decode.decode_all(str(path))[idx])


def test_auto_backend_falls_back_to_pyav_when_decord_fails_to_read(demo_data_dir):
    path = str(_videos(demo_data_dir)[2])
    reader = decode.open_video(path, "auto")
    assert isinstance(reader, decode.AutoReader)
    reader._decord._vr = None  # decord breaks after opening (as on a file corrupt mid-stream)
    frames = reader.read([0, 3, 7])
    reader.close()
    assert np.array_equal(frames, decode.decode_all(path)[[0, 3, 7]])


def test_frame_cache_hits_and_invalidation(demo_data_dir, tmp_path):
    v = tmp_path / "v.mp4"
    shutil.copy(_videos(demo_data_dir)[0], v)
    cfg = DataConfig(frame_cache_mib=7)
    cache = decode.frame_cache(7)
    cache.clear()
    (a,) = load_visuals(_record("r", [v]), cfg, factor=28)
    hits = cache.hits
    (b,) = load_visuals(_record("r", [v]), cfg, factor=28)
    assert cache.hits == hits + 1 and np.array_equal(a.frames, b.frames)
    write_mp4(v, render("blue", "left", 1, 56, 8))  # a new file under the same name: no stale frames
    (c,) = load_visuals(_record("r", [v]), cfg, factor=28)
    assert not np.array_equal(a.frames, c.frames)
    small = decode.FrameCache(100)
    small.put("a", np.zeros(60, np.uint8))
    small.put("b", np.zeros(60, np.uint8))
    assert small.get("a") is None and small.get("b") is not None and small.nbytes == 60


# ------------------------------------------------------------------------------ bad input
def _make_bad(kind: str, good: Path, d: Path) -> Path:
    """A broken media file of each kind (all real files on disk)."""
    data = good.read_bytes()
    if kind == "missing":
        return d / "missing.mp4"
    if kind == "truncated":
        (d / "trunc.mp4").write_bytes(data[: len(data) // 2])
        return d / "trunc.mp4"
    if kind == "truncated_faststart":
        path = d / "fs.mp4"
        with av.open(str(path), "w", options={"movflags": "faststart"}) as c:
            s = c.add_stream("libx264", rate=4)
            s.width = s.height = 56
            s.pix_fmt = "yuv420p"
            for f in render("red", "up", 2):
                for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
        raw = path.read_bytes()
        cut = raw.find(b"mdat") + 4 + 200
        path.write_bytes(raw[:cut])
        return path
    if kind == "zero_frames":
        path = d / "zero.mp4"
        c = av.open(str(path), "w")
        s = c.add_stream("libx264", rate=4)
        s.width = s.height = 56
        s.pix_fmt = "yuv420p"
        c.start_encoding()
        c.close()
        return path
    if kind == "codec":
        (d / "codec.mp4").write_bytes(data.replace(b"avc1", b"zzz9"))
        return d / "codec.mp4"
    if kind == "garbage":
        (d / "garbage.mp4").write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
        return d / "garbage.mp4"
    if kind == "bad_image":
        (d / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10)
        return d / "bad.png"
    if kind == "truncated_image":
        png = sorted((good.parent.parent / "images").glob("*.png"))[0].read_bytes()
        (d / "half.png").write_bytes(png[: len(png) // 2])
        return d / "half.png"
    raise AssertionError(kind)


BAD = ["missing", "truncated", "truncated_faststart", "zero_frames", "codec", "garbage", "bad_image",
       "truncated_image"]


@pytest.mark.parametrize("backend", ["auto", "pyav"])
@pytest.mark.parametrize("kind", BAD)
def test_bad_media_gives_data_error(kind, backend, demo_data_dir, tmp_path):
    good = _videos(demo_data_dir)[0]
    bad = _make_bad(kind, good, tmp_path)
    is_image = "image" in kind
    rec = _record(f"rec-{kind}", videos=[] if is_image else [good, bad], images=[bad] if is_image else [])
    with pytest.raises(DataError) as info:
        load_visuals(rec, _cfg(video_backend=backend), factor=28)
    msg = str(info.value)
    assert f"rec-{kind}" in msg and str(bad) in msg
    assert info.value.record_id == f"rec-{kind}" and info.value.path == str(bad)
    expected = {"missing": "missing_file", "zero_frames": "zero_frames", "bad_image": "bad_image",
                "truncated_image": "bad_image"}.get(kind, "unreadable_video")
    assert info.value.kind == expected


def test_iterator_skips_and_counts_bad_records(demo_data_dir, tmp_path):
    good = _videos(demo_data_dir)[0]
    records = [_record(f"bad-{k}", images=[p]) if "image" in k else _record(f"bad-{k}", [p])
               for k in BAD for p in [_make_bad(k, good, tmp_path)]]
    records += [_record(f"good-{i}", [v]) for i, v in enumerate(_videos(demo_data_dir)[:4])]
    before = ERRORS.labels(kind="data")._value.get()
    got = [r.id for r, _v in iter_samples(records, _cfg(), shard=0, num_shards=1, seed=0, epochs=2, factor=28)]
    assert sorted(got) == sorted([f"good-{i}" for i in range(4)] * 2)
    assert ERRORS.labels(kind="data")._value.get() - before == len(BAD)  # once each, not once per epoch
    with pytest.raises(DataError, match="no usable record"):
        list(iter_samples(records[:3], _cfg(), shard=0, num_shards=1, seed=0, epochs=None, factor=28))


def test_record_without_gpt_turn_is_skipped_and_counted(tmp_path, demo_data_dir):
    rows = [
        {"id": "no-gpt", "conversations": [{"from": "human", "value": "<video> what?"}], "video": "v.mp4"},
        {"id": "ok", "conversations": [{"from": "human", "value": "<video> what?"},
                                       {"from": "gpt", "value": "<answer>B</answer>"}],
         "video": str(_videos(demo_data_dir)[0])},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    before = ERRORS.labels(kind="data")._value.get()
    records = load_records(path, _cfg())
    assert [r.id for r in records] == ["ok"]
    assert ERRORS.labels(kind="data")._value.get() - before == 1
    (rec, vis), = list(iter_samples(records, _cfg(), shard=0, num_shards=1, seed=0, epochs=1, factor=28))
    assert rec.id == "ok" and rec.answer == "B" and vis[0].frames.shape[0] == 4


# ------------------------------------------------------------------------------ iterator
def test_shards_are_disjoint_and_shuffled_deterministically(demo_data_dir):
    records = load_records(demo_data_dir / "train.jsonl", _cfg())
    shards = [shard_records(records, k, 3) for k in range(3)]
    ids = [r.id for s in shards for r in s]
    assert sorted(ids) == sorted(r.id for r in records) and len(set(ids)) == len(ids)
    assert epoch_order(10, 0, 1, 0) == epoch_order(10, 0, 1, 0) != epoch_order(10, 0, 1, 1)
    assert sorted(epoch_order(10, 5, 0, 3)) == list(range(10))
    it = iter_samples(records, _cfg(), shard=1, num_shards=3, seed=0, epochs=1.5, factor=28)
    got = [r.id for r, _ in it]
    assert len(got) == int(np.ceil(1.5 * len(shards[1])))
    assert set(got) == {r.id for r in shards[1]}
    with pytest.raises(ValueError):
        shard_records(records, 3, 3)


@pytest.mark.parametrize("what", ["fifo", "device", "folder"])
def test_a_path_that_is_not_a_regular_file_is_named_as_such_not_missing(what, tmp_path):
    """A FIFO (reading it would block forever), a device such as /dev/zero (never ends) or a folder."""
    import os

    path = {"fifo": tmp_path / "clip.mp4", "device": Path("/dev/zero"), "folder": tmp_path}[what]
    if what == "fifo":
        os.mkfifo(path)
    with pytest.raises(DataError) as info:
        load_visuals(_record("rec-odd", [path]), _cfg(), factor=28)
    assert info.value.kind == "not_a_file" and "is not a regular file" in str(info.value) and str(path) in str(info.value)
