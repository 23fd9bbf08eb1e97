"""Records: LLaVA JSON/JSONL parsing, ground truth, placeholders, meta, paths, HF datasets, demo data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamgrpo.config import DataConfig
from streamgrpo.data.records import (
    DataError,
    DataFileNotFound,
    ground_truth,
    load_records,
    parse_record,
    read_records,
)
from streamgrpo.metrics import ERRORS
from streamgrpo.recipes.demo.data import SQUARE, left_half_percent, make_demo, render, trajectory


def _row(rid="r1", q="<video>\nWhat?", a="<think>hm</think> <answer>(B) Collision</answer>", **kw):
    conv = [{"from": "human", "value": q}] + ([{"from": "gpt", "value": a}] if a is not None else [])
    return {"id": rid, "conversations": conv, **kw}


def _write(path: Path, rows, jsonl=True) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows))
    return path


def test_jsonl_and_json_array_give_the_same_records(tmp_path):
    rows = [_row("a", video="v/a.mp4"), _row("b", q="<image> and <video>?", video=["x.mp4"], image="i.png")]
    cfg = DataConfig()
    a = load_records(_write(tmp_path / "d.jsonl", rows), cfg)
    b = load_records(_write(tmp_path / "d.json", rows, jsonl=False), cfg)
    assert [r.__dict__ | {"source": ""} for r in a] == [r.__dict__ | {"source": ""} for r in b]
    r = a[0]
    assert r.id == "a" and r.question == "<video>\nWhat?"
    assert r.answer == "(B) Collision" and r.solution.startswith("<think>")
    assert r.videos == [str(tmp_path / "v/a.mp4")]  # relative to the records file's directory
    assert a[1].media() == [("image", str(tmp_path / "i.png")), ("video", str(tmp_path / "x.mp4"))]
    assert a[0].source.endswith("d.jsonl:1") and b[1].source.endswith("d.json#1")


def test_media_root_and_absolute_paths(tmp_path):
    rows = [_row("a", video=["rel.mp4", "/abs/b.mp4"], q="<video><video>?")]
    (r,) = load_records(_write(tmp_path / "d.jsonl", rows), DataConfig(media_root="/data/media"))
    assert r.videos == ["/data/media/rel.mp4", "/abs/b.mp4"]


@pytest.mark.parametrize("gpt,tag,want", [
    ("<think>x</think> <answer>(B) Collision</answer>", "answer", "(B) Collision"),
    ("Collision", "answer", "Collision"),
    ("  42  ", "answer", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "answer", "2"),
    ("<reasoning>r</reasoning><final>B</final>", "final", "B"),
])
def test_ground_truth(gpt, tag, want):
    assert ground_truth(gpt, tag) == want


def test_turn_synonyms_and_video_r1_format(tmp_path):
    raw = {"id": "x", "conversations": [{"role": "user", "content": "<image> Q"}, {"role": "assistant", "content": "A"}],
           "image": "i.png"}
    r = parse_record(raw, media_root=tmp_path)
    assert r.answer == "A" and r.images == [str(tmp_path / "i.png")]
    vr1 = {"problem_id": 7, "problem": "Which?", "options": ["A. cat", "B. dog"], "solution": "<answer>B</answer>",
           "path": "./clips/a.mp4", "data_type": "video", "problem_type": "multiple choice"}
    r = parse_record(vr1, media_root=tmp_path)
    assert r.id == "7" and r.answer == "B" and r.kind == "multiple choice"
    assert r.question.startswith("<video>\n") and "B. dog" in r.question  # placeholder added, options kept
    assert r.videos == [str(tmp_path / "clips/a.mp4")]


def test_placeholders_are_added_only_when_there_are_none(tmp_path):
    r = parse_record(_row(q="Describe.", video=["a.mp4", "b.mp4"], image="c.png"), media_root=tmp_path)
    assert r.question == "<video>\n<video>\n<image>\nDescribe."
    with pytest.raises(DataError, match=r"'r1'.*1 <video>.*2 videos") as info:
        parse_record(_row(q="<video> and?", video=["a.mp4", "b.mp4"]), media_root=tmp_path, where="f.jsonl:3")
    assert info.value.kind == "placeholder_mismatch" and "f.jsonl:3" in str(info.value)


@pytest.mark.parametrize("raw,match,kind", [
    (_row(a=None), "no gpt turn", "no_answer"),
    (_row(a="   "), "no gpt turn", "no_answer"),
    ({"id": "r1", "conversations": []}, "no 'conversations'", "bad_record"),
    (_row(q=None), "no human turn", "bad_record"),
    (_row(video=5), "'video' must be a path", "bad_record"),
    (_row(video="a.mp4", meta={"min_frames": 0}), "meta.min_frames", "bad_record"),
    (_row(video="a.mp4", meta={"min_frames": 9, "max_frames": 4}), "min_frames", "bad_record"),
    (_row(video="a.mp4", meta={"fps": -1}), "meta.fps", "bad_record"),
    (_row(video="a.mp4", meta={"dynamic_sample": "yes"}), "dynamic_sample", "bad_record"),
    (_row(video="a.mp4", meta={"frame_cnts": [3, 4]}), "2 entries for 1 videos", "placeholder_mismatch"),
    ([1, 2], "not a JSON object", "bad_record"),
])
def test_bad_records_name_the_record_and_file(raw, match, kind, tmp_path):
    with pytest.raises(DataError, match=match) as info:
        parse_record(raw, media_root=tmp_path, where="data.jsonl:7", default_id="data-6")
    assert info.value.kind == kind
    assert "data.jsonl:7" in str(info.value)
    assert info.value.record_id in ("r1", "data-6")


def test_read_records_collects_errors_and_load_counts_them(tmp_path):
    lines = [json.dumps(_row("ok", video="a.mp4")), "{not json", json.dumps(_row("nogpt", a=None)),
             json.dumps(_row("ok", video="b.mp4")), json.dumps(_row("ok2", video="c.mp4", meta={"kind": "colour"}))]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    recs, errs = read_records(path, DataConfig())
    assert [r.id for r in recs] == ["ok", "ok2"]
    assert sorted(e.kind for e in errs) == ["bad_record", "bad_record", "no_answer"]
    assert any("d.jsonl:2" in str(e) for e in errs) and any("duplicate" in str(e) for e in errs)
    before = ERRORS.labels(kind="data")._value.get()
    assert [r.id for r in load_records(path, DataConfig(kinds=["colour"]))] == ["ok2"]
    assert ERRORS.labels(kind="data")._value.get() - before == 3
    with pytest.raises(DataError, match="no usable records"):
        load_records(path, DataConfig(kinds=["nothing"]))
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "nope.jsonl", DataConfig())


def test_missing_data_file_is_its_own_error_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(DataFileNotFound) as err:
        load_records(missing, DataConfig())
    assert str(err.value) == f"data file not found: {missing}"  # the file, not "record (...)"
    assert err.value.path == str(missing) and err.value.kind == "missing_file"
    assert isinstance(err.value, DataError)  # callers that catch DataError still do
    with pytest.raises(DataFileNotFound, match="nowhere"):
        read_records(missing, DataConfig())


def test_make_demo_if_missing(tmp_path):
    from streamgrpo.recipes.demo.assets import prepare_data
    from streamgrpo.recipes.demo.config import DemoConfig

    path = tmp_path / "demo" / "train.jsonl"
    assert prepare_data(DemoConfig(make_data=True, size=10), path)
    recs = load_records(path, DataConfig())
    assert len(recs) == 10 and path.exists()


# ------------------------------------------------------------------------------ HF datasets
def test_hf_saved_dataset_source(tmp_path, demo_data_dir, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("STREAMGRPO_CACHE", str(tmp_path / "cache"))
    vids = sorted(str(p) for p in (demo_data_dir / "videos").glob("*.mp4"))[:2]
    img = sorted((demo_data_dir / "images").glob("*.png"))[0]
    ds = datasets.Dataset.from_dict({
        "id": ["h0", "h1", "h2"],
        "clip": [vids[0], vids[1], None],
        "picture": [None, None, str(img)],
        "prompt": ["What colour?", "<video> Which way?", "Colour of the image?"],
        "label": ["<answer>(A) red</answer>", "(B) right", "green"],
    }).cast_column("picture", datasets.Image())
    ds.save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(hf_video_column="clip", hf_image_column="picture", hf_question_column="prompt",
                     hf_answer_column="label")
    recs = load_records(tmp_path / "hf", cfg)
    assert [r.id for r in recs] == ["h0", "h1", "h2"]
    assert recs[0].question == "<video>\nWhat colour?" and recs[0].answer == "(A) red" and recs[0].videos == [vids[0]]
    assert recs[1].question == "<video> Which way?" and recs[1].answer == "(B) right"
    (kind, path), = recs[2].media()
    assert kind == "image" and Path(path).read_bytes() == img.read_bytes()  # embedded image written once
    assert Path(path).is_relative_to(tmp_path / "cache")
    from streamgrpo.data.video import load_visuals

    (vis,) = load_visuals(recs[2], cfg, factor=28)
    assert vis.frames.shape == (1, 56, 56, 3)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert [r.id for r in load_records(tmp_path / "d.parquet", cfg)] == ["h0", "h1", "h2"]
    ds.remove_columns("picture").to_json(str(tmp_path / "flat.jsonl"))
    flat = load_records(tmp_path / "flat.jsonl", cfg.model_copy(update={"source": "hf"}))
    assert [r.answer for r in flat] == ["(A) red", "(B) right", "green"] and not flat[2].media()
    with pytest.raises(DataError, match="no column 'question'"):
        load_records(tmp_path / "hf", DataConfig(hf_answer_column="label"))


# ------------------------------------------------------------------------------ demo data
def test_demo_data_set(demo_data_dir, tmp_path):
    train = [json.loads(x) for x in (demo_data_dir / "train.jsonl").read_text().splitlines()]
    test = (demo_data_dir / "test.jsonl").read_text().splitlines()
    assert len(train) == 40 and len(test) == 10
    kinds = {r["meta"]["kind"] for r in train}
    assert kinds == {"colour", "direction", "numeric", "multi_video"}
    recs = load_records(demo_data_dir / "train.jsonl", DataConfig())
    for r in recs:
        assert all(Path(v).exists() for v in r.videos)
        if r.kind == "colour":
            assert "(A) red (B) green (C) blue" in r.question
            assert r.answer in ("(A) red", "(B) green", "(C) blue")
            colour = r.answer.split()[1]
            assert f"v_{colour}_" in r.videos[0]
        if r.kind == "multi_video":
            assert 2 <= len(r.videos) <= 4 and r.question.count("<video>") == len(r.videos)
            k = int(r.answer.strip("()")) - 1
            assert "v_red_" in r.videos[k] and sum("v_red_" in v for v in r.videos) == 1
        if r.kind == "numeric":
            assert 0.0 <= float(r.answer) <= 100.0
    images = load_records(demo_data_dir / "train_image.jsonl", DataConfig())
    assert images and all(r.images and not r.videos and r.kind == "colour_image" for r in images)
    again = make_demo(tmp_path / "again", n=40, seed=0)
    assert (again / "train.jsonl").read_bytes() == (demo_data_dir / "train.jsonl").read_bytes()
    other = make_demo(tmp_path / "other", n=40, seed=1)
    assert (other / "train.jsonl").read_bytes() != (demo_data_dir / "train.jsonl").read_bytes()


def test_demo_clip_geometry():
    frames = render("green", "right", 0)
    assert frames.shape == (8, 56, 56, 3) and frames.dtype == np.uint8
    ys, xs = np.nonzero(frames[0, :, :, 1] == 180)
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (SQUARE, SQUARE) == (28, 28) and xs.min() == 0
    assert np.nonzero(frames[-1, :, :, 1] == 180)[1].max() == 55  # moved across to the right edge
    assert [y for y, _x in trajectory("down", 5)] == sorted(y for y, _x in trajectory("down", 5))
    assert left_half_percent("right", 0) == 50.0 and left_half_percent("left", 0) == 50.0
    assert left_half_percent("up", 0) == 100.0 and left_half_percent("up", 8) == 0.0


def test_reverse_motion_shows_the_same_frames_in_the_opposite_order():
    for start in range(12):
        for fwd, back in (("right", "left"), ("down", "up")):
            a = render("red", fwd, start, motion="reverse")
            b = render("red", back, start, motion="reverse")
            assert np.array_equal(a[::-1], b)  # only the order tells left from right
            assert not np.array_equal(a, b)
    # the default (mirror) left clip is not the reversed right clip once the phase is past 0
    assert trajectory("left", 3) != trajectory("right", 3)[::-1]
    assert trajectory("left", 3, motion="reverse") == trajectory("right", 3)[::-1]
    assert left_half_percent("left", 3, motion="reverse") == left_half_percent("right", 3)
    with pytest.raises(ValueError, match="motion"):
        trajectory("left", 0, motion="sideways")


def test_reverse_demo_data_set_uses_its_own_clip_files(tmp_path):
    import av

    root = make_demo(tmp_path / "rev", n=40, seed=0, motion="reverse")
    records = load_records(root / "train.jsonl", DataConfig())
    videos = sorted({v for r in records for v in r.videos})
    assert videos and all(Path(v).stem.endswith("r") for v in videos)
    left = next(r for r in records if r.kind == "direction" and r.answer.endswith("left"))
    with av.open(str(root / left.videos[0])) as c:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    colour = Path(left.videos[0]).stem.split("_")[1]
    _d, start = Path(left.videos[0]).stem.rsplit("_", 1)
    expected = render(colour, "left", int(start[:-1]), motion="reverse")
    assert np.abs(decoded.astype(int) - expected.astype(int)).mean() < 4  # lossy codec, same picture
    with pytest.raises(ValueError, match="motion"):
        make_demo(tmp_path / "bad", n=10, motion="sideways")


def test_a_huge_question_is_refused_and_named(tmp_path):
    """A 100 MB question crash-looped a generator's tokenizer; now it is one data error that names it."""
    raw = _row(q="<video> " + "x" * 200, video="a.mp4")
    with pytest.raises(DataError) as err:
        parse_record(raw, media_root=tmp_path, where="d.jsonl:4", max_question_chars=100)
    assert err.value.kind == "too_long" and "over data.max_question_chars (100)" in str(err.value)
    assert parse_record(raw, media_root=tmp_path, max_question_chars=1000).question.startswith("<video>")


def test_an_explicit_media_root_is_a_boundary(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    inside = parse_record(_row(q="<video> q", video="clips/a.mp4"), media_root=root, bounded=True)
    assert inside.videos == [str(root / "clips" / "a.mp4")]
    for escape in ("../secret.mp4", "clips/../../secret.mp4", "clips/../../media-other/x.mp4"):
        with pytest.raises(DataError) as err:
            parse_record(_row(q="<video> q", video=escape), media_root=root, bounded=True)
        assert err.value.kind == "outside_media_root" and "lies outside data.media_root" in str(err.value)
    absolute = str(tmp_path / "elsewhere.mp4")  # an absolute path names its file itself (documented)
    assert parse_record(_row(q="<video> q", video=absolute), media_root=root, bounded=True).videos == [absolute]
    # without an explicit media_root (the records' own folder) relative paths may go up, as data sets do
    assert parse_record(_row(q="<video> q", video="../videos/a.mp4"), media_root=root).videos


def test_records_over_the_size_are_skipped_and_counted_and_data_check_names_them(tmp_path):
    import json

    from streamgrpo.config import DataConfig
    from streamgrpo.data.records import iter_raw

    f = tmp_path / "d.jsonl"
    rows = [_row(q="<video> short", video="a.mp4"), _row(q="<video> " + "y" * 500, video="a.mp4")]
    rows[1]["id"] = "huge-1"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    items = list(iter_raw(f, DataConfig(max_question_chars=100)))
    bad = [i for i in items if isinstance(i, DataError)]
    assert len(items) == 2 and len(bad) == 1 and bad[0].record_id == "huge-1" and bad[0].kind == "too_long"
    import io

    from streamgrpo.data.check import run_check

    report = io.StringIO()
    assert run_check(str(f), DataConfig(max_question_chars=100), out=report) == 1
    line = next(x for x in report.getvalue().splitlines() if "too_long" in x)
    assert line.startswith("ERROR too_long") and "huge-1" in line and "data.max_question_chars (100)" in line
