"""Visuals by reference, the pure parts: how paths are named and resolved, the Redis byte budget,
the media-root check, and the read-ahead's order of reads (a list-backed queue: pure logic)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamgrpo.config import DataConfig, load_config


def test_a_reference_names_its_file_relative_to_the_media_root_and_resolves_back(tmp_path):
    from streamgrpo.data.records import ref_file, ref_path

    root = tmp_path / "data"
    (root / "videos").mkdir(parents=True)
    cfg = DataConfig(train_path=str(root / "train.jsonl"))
    assert ref_path(str(root / "videos" / "a.mp4"), cfg) == "videos/a.mp4"
    assert ref_path(str(tmp_path / "elsewhere.mp4"), cfg) is None  # outside the root: the learner refuses it, inline
    assert ref_file("videos/a.mp4", cfg) == str(root / "videos" / "a.mp4")
    other = DataConfig(train_path=str(tmp_path / "other" / "train.jsonl"), media_root=str(tmp_path / "mnt"))
    assert ref_file("videos/a.mp4", other) == str(tmp_path / "mnt" / "videos" / "a.mp4")  # another host's mount
    with pytest.raises(ValueError, match="lies outside data.media_root"):
        ref_file("../../etc/passwd", cfg)
    assert ref_file(str(root / "videos" / "a.mp4"), cfg) == str(root / "videos" / "a.mp4")  # absolute, inside
    with pytest.raises(ValueError, match="lies outside data.media_root"):
        ref_file("/srv/clips/a.mp4", cfg)  # no data.media_root: the training file's folder bounds references
    with pytest.raises(ValueError, match="lies outside data.media_root"):
        ref_file("/srv/clips/a.mp4", other)


def test_a_reference_cannot_leave_the_media_root_through_a_symlink_or_name_proc(tmp_path):
    """Resolved with realpath: a link inside the root that points out of it is refused (naming where it
    leads), /proc/self/environ is refused with data.media_root unset; a link that stays inside is fine,
    and a generator sends a file that leaves its root inline instead of by a reference the learner refuses."""
    from streamgrpo.data.records import ref_file, ref_path

    root = tmp_path / "data"
    (root / "videos").mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (root / "videos" / "a.mp4").write_bytes(b"x")
    (root / "videos" / "escape.mp4").symlink_to(secret)
    (root / "videos" / "alias.mp4").symlink_to(root / "videos" / "a.mp4")
    (root / "up").symlink_to(tmp_path)
    cfg = DataConfig(train_path=str(root / "train.jsonl"))  # media_root unset: the demo's default
    with pytest.raises(ValueError, match=f"a symlink: it resolves to {secret}"):
        ref_file("videos/escape.mp4", cfg)
    with pytest.raises(ValueError, match="a symlink"):
        ref_file("up/secret.txt", cfg)  # a linked folder
    with pytest.raises(ValueError, match="lies outside data.media_root"):
        ref_file("/proc/self/environ", cfg)
    with pytest.raises(ValueError, match="lies outside data.media_root"):
        ref_file("/proc/self/environ", DataConfig(media_root=str(root)))
    assert ref_file("videos/alias.mp4", cfg) == str(root / "videos" / "a.mp4")
    assert ref_path(str(root / "videos" / "escape.mp4"), cfg) is None
    assert ref_path(str(root / "videos" / "alias.mp4"), cfg) == "videos/alias.mp4"


def test_a_file_extracted_from_a_datasets_row_travels_inline(tmp_path, monkeypatch):
    from streamgrpo.data import records

    monkeypatch.setattr(records, "_cache_dir", lambda: tmp_path / "cache")
    cfg = DataConfig(train_path=str(tmp_path / "ds"))
    assert records.ref_path(str(tmp_path / "cache" / "hf_media" / "x" / "img.png"), cfg) is None


def test_media_root_check_says_why_in_one_line(tmp_path):
    from streamgrpo.learner.intake.media import check_media_root

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("")
    assert check_media_root(DataConfig(train_path=str(tmp_path / "d" / "train.jsonl"))) is None
    line = check_media_root(DataConfig(media_root=str(tmp_path / "missing")))
    assert line == f"data.media_root {tmp_path / 'missing'} is not a directory here"
    if os.geteuid() != 0:  # root reads everything
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        assert "not readable" in check_media_root(DataConfig(media_root=str(locked)))


def test_an_empty_media_root_is_unusable(tmp_path):
    from streamgrpo.learner.intake.media import check_media_root

    (tmp_path / "mnt").mkdir()
    assert check_media_root(DataConfig(media_root=str(tmp_path / "mnt"))) == \
        f"data.media_root {tmp_path / 'mnt'} is empty (not mounted here?)"


def test_the_media_watch_stops_only_after_the_time_and_with_the_root_gone(tmp_path):
    """Pure logic under a fake clock: failures with the root readable never stop the learner; with the
    root removed they do, once nothing resolved for after_s; one success starts the time again."""
    import shutil

    from streamgrpo.learner.intake.media import MediaError, MediaUnavailable, MediaWatch

    root = tmp_path / "media"
    root.mkdir()
    (root / "a.mp4").write_bytes(b"x")
    now, slept = [0.0], []
    watch = MediaWatch(DataConfig(media_root=str(root)), after_s=30.0, clock=lambda: now[0], sleep=slept.append)
    bad = MediaError("media_missing", "visuals[0]: media file /x not found")
    for t in range(0, 100, 5):  # 100 s of nothing but failures: the root is there, so they are the groups' fault
        now[0] = float(t)
        watch.failed(bad)
    assert slept == []  # and they are read at full speed
    shutil.rmtree(root)
    watch.resolved()
    now[0] = 100.0
    watch.failed(bad)
    now[0] = 129.0
    watch.failed(bad)  # 29 s without a success: not yet, but the learner reads slowly meanwhile
    assert slept == [1.0, 1.0]
    now[0] = 131.0
    with pytest.raises(MediaUnavailable) as exc:
        watch.failed(bad)
    line = str(exc.value)
    assert "no group by reference could be resolved here for 31 s" in line and "\n" not in line
    assert f"data.media_root {root} is not a directory here" in line and "media_missing" in line


def test_redis_budget_counts_the_window_and_warns_against_maxmemory():
    from streamgrpo.config.budget import held_bytes, held_groups, message_bytes, redis_budget_warning

    inline = load_config("qwen2_5_vl_7b_video", ["rollout.media=inline"])
    ref = load_config("qwen2_5_vl_7b_video")
    sync = load_config("qwen2_5_vl_7b_video", ["learner.async_checkpoint=false"])
    assert held_groups(sync) == (50 + 2) * 64 + 256  # the window, the step collected and the one read ahead, the backlog
    # DeepSpeed ranks (this config) and the torch backend alike: a background write holds its window longer
    for cfg in (ref, load_config("qwen2_5_vl_7b_video", ["learner.backend=torch"])):
        assert held_groups(cfg) == (2 * 50 + 2) * 64 + 256
        assert "(2 x save_steps (async_checkpoint) + 2) x groups_per_step" in redis_budget_warning(cfg, 1 << 20)
    assert message_bytes(inline) > ref.data.total_pixels * 3  # pixels dominate inline
    assert message_bytes(ref) * 50 < message_bytes(inline)
    assert held_bytes(inline) > 16 << 30 > held_bytes(ref) * 1.25  # a 16 GiB Redis: too small inline only
    line = redis_budget_warning(inline, 16 << 30)
    assert line.startswith("Redis maxmemory 16.0 GiB is below what this run may hold, ~")
    assert "rollout.media: reference" in line
    assert redis_budget_warning(ref, 16 << 30) is None
    assert redis_budget_warning(inline, 0) is None  # no limit


class _ListQueue:
    """A queue over a list of items, recording each get (n, timeout)."""

    def __init__(self, items):
        self.items, self.calls = list(items), []

    def get(self, n, timeout_s):
        self.calls.append((n, timeout_s))
        out, self.items = self.items[:n], self.items[n:]
        return out


class _Resolver:
    def __init__(self):
        self.submitted = []

    def submit(self, deliveries):
        self.submitted += deliveries
        return any(d.startswith("ref") for d in deliveries)


def test_read_ahead_reads_the_next_step_only_once_references_are_seen():
    from streamgrpo.learner.intake.media import ReadAhead

    q = _ListQueue(["in0", "in1", "ref2", "ref3", "ref4", "ref5", "ref6", "ref7"])
    r = _Resolver()
    ahead = ReadAhead(q, r, ahead=2)
    assert ahead.get(2, 5.0) == ["in0", "in1"] and ahead.buffered == 0  # inline only: no read-ahead
    assert ahead.get(2, 5.0) == ["ref2", "ref3"] and ahead.buffered == 2  # the next step's two, decoding already
    assert q.calls[-1] == (2, 0.0)  # read without waiting
    assert r.submitted == ["in0", "in1", "ref2", "ref3", "ref4", "ref5"]
    assert ahead.get(3, 5.0) == ["ref4", "ref5", "ref6"]  # the buffer first, the rest without waiting
    assert q.calls[-2] == (1, 0.0)
    assert ahead.get(2, 5.0) == ["ref7"] and q.items == []


def test_frames_digest_is_of_the_bytes_in_c_order():
    from streamgrpo.wire.media import digest_matches, frames_digest

    a = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    assert frames_digest(a) == frames_digest(np.asfortranarray(a))  # the same pixels, another memory layout
    assert frames_digest(a, "sha256").startswith("sha256:") and len(frames_digest(a, "sha256")) == 7 + 64
    b = a.copy()
    b[1, 3, 5, 2] ^= 1
    assert not digest_matches(b, frames_digest(a)) and digest_matches(a, frames_digest(a, "blake2b"))
    assert not digest_matches(a, "md5:" + "0" * 32)
