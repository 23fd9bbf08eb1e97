"""Visuals by reference against real files that lie: a source larger than the learner decodes (refused
from its header, before any frame is decoded) and a file swapped for a FIFO (opened once, without
blocking, decoded from that descriptor). Real MJPEG/mp4/PNG files written with PyAV and PIL, a real FIFO."""

from __future__ import annotations

import os
import struct
import threading
import zlib

import numpy as np
import pytest

from streamgrpo import metrics as M
from streamgrpo.config import DataConfig
from streamgrpo.data.video import decode_resized
from streamgrpo.learner.intake import media as media_mod
from streamgrpo.learner.intake.media import MediaError, MediaResolver
from streamgrpo.wire import MediaRef, ScoredGroup, Visual
from streamgrpo.wire.media import frames_digest

JOIN_S = 60.0  # a regression hangs in the kernel's FIFO open: the test fails after this instead of hanging


def _decodes() -> float:
    """How many decodes the learner has timed (``media_decode_seconds``' count)."""
    for metric in M.MEDIA_DECODE_SECONDS.collect():
        for s in metric.samples:
            if s.name.endswith("_count"):
                return s.value
    return 0.0


def _mjpeg(path, n: int, height: int, width: int) -> None:
    import av

    with av.open(str(path), "w", format="avi") as c:
        s = c.add_stream("mjpeg", rate=4)
        s.width, s.height, s.pix_fmt = width, height, "yuvj420p"
        for t in range(n):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 40 * t % 256, np.uint8), format="rgb24")
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)


def _png_header(path, height: int, width: int) -> None:
    """A PNG whose header says ``height`` x ``width`` (its data is a few bytes: decoding it would fail,
    reading its header costs nothing)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def _visual(kind: str, name: str, height: int, width: int, indices, digest: str) -> Visual:
    ref = MediaRef(path=name, height=height, width=width, digest=digest, decoder="auto")
    return Visual(kind=kind, frames=None, fps=4.0 if kind == "video" else 0.0,
                  frame_indices=np.asarray(indices if kind == "video" else [], dtype=np.int32), ref=ref)


def _group(v: Visual) -> ScoredGroup:
    return ScoredGroup(prompt_id="p", generator_id="gen", policy_version=0, model_id="m",
                       prompt_ids=np.asarray([1, 2], dtype=np.int32), visuals=[v], answer="a", completions=[])


@pytest.fixture()
def root(tmp_path):
    (tmp_path / "media").mkdir()
    return tmp_path / "media"


def _resolver(root, **kw) -> MediaResolver:
    return MediaResolver(DataConfig(train_path=str(root / "train.jsonl")), cache_mib=16, **kw)


def test_a_video_larger_than_it_declares_is_size_mismatch_before_any_frame_is_decoded(root):
    """8 frames declared 56 x 56, the file's frames are 2000 x 2000 (over learner.max_source_pixels here):
    refused from the container's header, one line naming the file and both sizes, the decoder never run."""
    _mjpeg(root / "big.avi", 8, 2000, 2000)
    resolver = _resolver(root, max_source_pixels=1000 * 1000)
    before = _decodes()
    with pytest.raises(MediaError) as err:
        resolver.resolve(_group(_visual("video", "big.avi", 56, 56, range(8), "sha256:" + "0" * 64)))
    assert err.value.label == "size_mismatch"
    msg = str(err.value)
    assert "\n" not in msg and "big.avi" in msg and "2000x2000" in msg and "56x56" in msg
    assert _decodes() == before  # nothing was decoded: the memory a lie costs is its header's
    resolver.close()


def test_an_image_whose_header_says_13000_squared_is_refused_under_the_default_limit(root):
    """The default learner.max_source_pixels (8K UHD) refuses a 13000 x 13000 PNG declared 28 x 28 (PIL's
    own limit lets it decode: 2.4 GB) from PIL's header, before ``load``."""
    _png_header(root / "huge.png", 13000, 13000)
    resolver = _resolver(root)
    before = _decodes()
    with pytest.raises(MediaError) as err:
        resolver.resolve(_group(_visual("image", "huge.png", 28, 28, [], "sha256:" + "0" * 64)))
    assert err.value.label == "size_mismatch" and "13000x13000" in str(err.value)
    assert _decodes() == before
    resolver.close()


def test_files_within_the_limit_still_decode_from_their_descriptor(root):
    """The same checks pass honest files: an MJPEG video and a PNG resolve to the generator's pixels."""
    from PIL import Image

    _mjpeg(root / "ok.avi", 8, 64, 64)
    Image.fromarray(np.arange(64 * 48 * 3, dtype=np.uint8).reshape(48, 64, 3)).save(root / "ok.png")
    frames = decode_resized("video", str(root / "ok.avi"), [0, 3, 7], 56, 56, "auto")
    image = decode_resized("image", str(root / "ok.png"), [0], 28, 56, "auto")
    resolver = _resolver(root, max_source_pixels=64 * 64)
    got = resolver.resolve(_group(_visual("video", "ok.avi", 56, 56, [0, 3, 7], frames_digest(frames))))
    assert np.array_equal(got.visuals[0].frames, frames)
    got = resolver.resolve(_group(_visual("image", "ok.png", 28, 56, [], frames_digest(image))))
    assert np.array_equal(got.visuals[0].frames, image)
    resolver.close()


def _unblock(path) -> None:
    """Open a FIFO for writing and close it, so a reader hung in its open sees the end of it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def test_a_file_swapped_for_a_fifo_after_its_check_is_never_opened_again(root, monkeypatch):
    """The path is swapped for a FIFO between the check and the decode: the learner decodes the file it
    opened (its descriptor), never waits in the FIFO's open, and gets the generator's pixels."""
    _mjpeg(root / "clip.avi", 8, 64, 64)
    frames = decode_resized("video", str(root / "clip.avi"), [1, 5], 56, 56, "auto")
    path = str(root / "clip.avi")
    real_decode = media_mod.decode_resized

    def swap_then_decode(*args, **kwargs):
        os.rename(path, path + ".gone")
        os.mkfifo(path)  # what an attacker (or another job) puts in its place between check and decode
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(media_mod, "decode_resized", swap_then_decode)
    resolver = _resolver(root)
    result: dict = {}

    def run():
        try:
            result["group"] = resolver.resolve(_group(_visual("video", "clip.avi", 56, 56, [1, 5],
                                                              frames_digest(frames))))
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(JOIN_S)
    hung = t.is_alive()
    if hung:
        _unblock(path)
        t.join(JOIN_S)
    resolver.close()
    assert not hung, "the media thread waited in the FIFO's open"
    assert "error" not in result, result.get("error")
    assert np.array_equal(result["group"].visuals[0].frames, frames)


def test_a_fifo_or_a_folder_is_refused_in_one_line_without_blocking(root):
    os.mkfifo(root / "pipe.avi")
    (root / "dir.png").mkdir()
    resolver = _resolver(root)
    for name, kind, what in (("pipe.avi", "video", "a FIFO"), ("dir.png", "image", "a folder")):
        out: dict = {}
        t = threading.Thread(target=lambda o=out, k=kind, n=name: o.setdefault("r", _try(resolver, k, n)), daemon=True)
        t.start()
        t.join(JOIN_S)
        if t.is_alive():
            _unblock(root / name)
        assert not t.is_alive() and isinstance(out.get("r"), MediaError), out
        assert out["r"].label == "media_missing" and what in str(out["r"]) and "\n" not in str(out["r"])
    resolver.close()


def _try(resolver, kind: str, name: str):
    try:
        resolver.resolve(_group(_visual(kind, name, 56, 56, [0, 1], "sha256:" + "0" * 64)))
    except MediaError as exc:
        return exc
    return None
