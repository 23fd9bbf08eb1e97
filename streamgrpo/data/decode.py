"""Decoding: decord (default) with PyAV as fallback, only the sampled frames; images; LRU caches.

Both readers seek: decord by its own frame index, PyAV by an index of packet timestamps built by
demuxing (reading, not decoding) the stream once; each wanted frame is reached by seeking to the
key frame before it and decoding forward, so a sparse sample never decodes the whole video. The
two readers return the same RGB frames for the same indices (both convert with FFmpeg).

Frames are resized with PIL bicubic to the planned size. :class:`FrameCache` keeps resized frames
keyed by (path, file stat, indices, size) within a byte budget; a small probe cache keeps each
file's (frames, fps, height, width) so a cache hit opens no file at all.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # decord has no wheels for every platform; PyAV is the fallback
    import decord as _decord
except Exception:  # pragma: no cover - depends on the platform
    _decord = None


class DecodeError(RuntimeError):
    """A file exists but cannot be decoded; ``kind`` is zero_frames, unreadable_video or bad_image."""

    def __init__(self, message: str, kind: str = "unreadable_video"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float
    height: int
    width: int


def file_key(path: str) -> tuple[str, int, int]:
    """(path, mtime_ns, size): a changed file never hits a stale cache entry."""
    st = os.stat(path)
    return (path, st.st_mtime_ns, st.st_size)


class NotAFile(OSError):
    """The path names a FIFO, a device, a socket or a folder: never opened for reading (it could block)."""


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """``path`` opened once for reading without blocking (``O_NONBLOCK``: a FIFO swapped in never waits for a
    writer; ``O_NOFOLLOW``: a last component swapped for a symlink is refused), and its ``fstat``: the
    descriptor and what it holds. Raises :class:`NotAFile` (closing it) unless it is a regular file, or
    OSError (missing, unreadable, a symlink). Decode from :func:`fd_path`, so a swap of the path between
    this check and the decode cannot change what is read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise NotAFile(f"{path} is {what}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def fd_path(fd: int) -> str:
    """A path that opens the file behind the descriptor ``fd`` (its inode, whatever its name holds now)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


@dataclass(frozen=True)
class SourceSize:
    """A medium's size from its header alone (nothing decoded): frames (0: the header does not say)."""

    frames: int
    height: int
    width: int


def source_size(kind: str, path: str) -> SourceSize:
    """The native size of an image (PIL's header, before ``load``) or of a video's first stream (the
    container's and codec's header via PyAV, before any frame is decoded). Raises DecodeError."""
    if kind == "image":
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the caller judges the size
                with Image.open(path) as im:
                    w, h = im.size
        except Image.DecompressionBombError as exc:  # over twice PIL's own limit: its size is not given
            raise DecodeError(f"PIL refuses its header: {exc}", kind="too_large") from None
        except Exception as exc:
            raise DecodeError(f"cannot read the image: {exc}", kind="bad_image") from None
        return SourceSize(1, h, w)
    import av

    try:
        with av.open(path) as c:
            if not c.streams.video:
                raise DecodeError("file has no video stream")
            s = c.streams.video[0]
            ctx = s.codec_context
            height, width = int(getattr(ctx, "height", 0) or 0), int(getattr(ctx, "width", 0) or 0)
            return SourceSize(int(s.frames or 0), height, width)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"PyAV cannot read the header: {exc}") from None


def size_problem(src: SourceSize, indices: list[int], height: int, width: int, max_pixels: int) -> str | None:
    """Why a medium whose header says ``src`` may not be decoded for what a message declares (``indices``
    resized to ``height`` x ``width``): no frame size, or more than ``max_pixels`` native pixels per frame
    (the decode's memory grows with them, whatever the message declares); else None (pure)."""
    declared = f"declared {len(indices)} frame(s) of {height}x{width}"
    if src.height <= 0 or src.width <= 0:
        return f"its header gives no frame size ({declared})"
    if src.height * src.width > max_pixels:
        return (f"its frames are {src.height}x{src.width} ({src.height * src.width:,} pixels, over the "
                f"{max_pixels:,} a source frame may hold; {declared})")
    return None


# ------------------------------------------------------------------------------- readers
class DecordReader:
    name = "decord"

    def __init__(self, path: str):
        if _decord is None:
            raise DecodeError("decord is not installed")
        try:
            self._vr = _decord.VideoReader(path, ctx=_decord.cpu(0), num_threads=1)
        except AssertionError as exc:  # decord asserts frame count > 0
            raise DecodeError(f"decord: {exc}", kind="zero_frames") from None
        except Exception as exc:
            raise DecodeError(f"decord cannot open the video: {_clean(exc)}") from None
        total = len(self._vr)
        if total <= 0:
            raise DecodeError("video has no frames", kind="zero_frames")
        try:
            first = self._vr[0].asnumpy()
        except Exception as exc:
            raise DecodeError(f"decord cannot decode the first frame: {_clean(exc)}") from None
        self.info = VideoInfo(total, float(self._vr.get_avg_fps() or 0.0), int(first.shape[0]), int(first.shape[1]))

    def read(self, indices: list[int]) -> np.ndarray:
        try:
            frames = self._vr.get_batch(list(indices)).asnumpy()
        except Exception as exc:
            raise DecodeError(f"decord cannot decode frames {_short(indices)}: {_clean(exc)}") from None
        if frames.shape[0] != len(indices):
            raise DecodeError(f"decord returned {frames.shape[0]} frames for {len(indices)} indices")
        return frames

    def close(self) -> None:
        self._vr = None


class PyAVReader:
    name = "pyav"

    def __init__(self, path: str):
        import av

        try:
            self._c = av.open(path)
        except Exception as exc:
            raise DecodeError(f"PyAV cannot open the file: {exc}") from None
        try:
            if not self._c.streams:
                raise DecodeError("file has no streams (a zero-frame video?)", kind="zero_frames")
            if not self._c.streams.video:
                raise DecodeError("file has no video stream")
            s = self._s = self._c.streams.video[0]
            if s.codec_context is None or not getattr(s.codec_context, "name", None):
                raise DecodeError("unsupported video codec")
            pts, keys = [], []
            for packet in self._c.demux(s):
                if packet.size == 0:
                    continue
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
            self._sequential = any(p is None for p in pts)
            self._pts = sorted(pts) if not self._sequential else []
            self._keys = sorted(k for k in keys if k is not None)
            total = len(pts)
            if total == 0:
                raise DecodeError("video has no frames", kind="zero_frames")
            if s.frames and total < s.frames:
                raise DecodeError(f"video truncated: the header lists {s.frames} frames, only {total} are present")
            fps = float(s.average_rate or s.guessed_rate or 0.0)
            height, width = s.codec_context.height, s.codec_context.width
            if not height or not width:
                raise DecodeError(f"unsupported video codec {s.codec_context.name!r} (no frame size)")
            self.info = VideoInfo(total, fps, int(height), int(width))
        except DecodeError:
            self._c.close()
            raise
        except Exception as exc:
            self._c.close()
            raise DecodeError(f"PyAV cannot read the stream: {exc}") from None

    def read(self, indices: list[int]) -> np.ndarray:
        try:
            by_index = self._read_sequential(indices) if self._sequential else self._read_seek(indices)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"PyAV cannot decode frames {_short(indices)}: {exc}") from None
        return np.stack([by_index[i] for i in indices])

    def _read_seek(self, indices: list[int]) -> dict[int, np.ndarray]:
        wanted = sorted(set(indices))
        if wanted[-1] >= len(self._pts):
            raise DecodeError(f"frame {wanted[-1]} requested but the video has {len(self._pts)} frames")
        want_pts = {self._pts[i]: i for i in wanted}
        got: dict[int, np.ndarray] = {}
        frames = None
        pos = None  # pts of the last decoded frame
        for i in wanted:
            target = self._pts[i]
            if i in got:
                continue
            k = bisect.bisect_right(self._keys, target) - 1
            key = self._keys[k] if k >= 0 else self._pts[0]
            if frames is None or pos is None or pos >= target or key > pos:
                self._c.seek(key, backward=True, any_frame=False, stream=self._s)
                frames = self._c.decode(self._s)
                pos = None
            for frame in frames:
                pos = frame.pts
                if pos in want_pts and want_pts[pos] not in got:
                    got[want_pts[pos]] = frame.to_ndarray(format="rgb24")
                if pos is not None and pos >= target:
                    break
            else:
                frames = None
            if i not in got:
                raise DecodeError(f"frame {i} could not be decoded (video truncated or corrupt?)")
        return got

    def _read_sequential(self, indices: list[int]) -> dict[int, np.ndarray]:
        wanted = set(indices)
        last = max(wanted)
        got: dict[int, np.ndarray] = {}
        self._c.seek(0)
        for n, frame in enumerate(self._c.decode(self._s)):
            if n in wanted:
                got[n] = frame.to_ndarray(format="rgb24")
            if n >= last:
                break
        missing = wanted - set(got)
        if missing:
            raise DecodeError(f"video ends before frame {min(missing)} (truncated or corrupt?)")
        return got

    def close(self) -> None:
        self._c.close()


def _clean(exc: Exception) -> str:
    """decord's first message line without its timestamp and source-file prefix."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    line = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
    return line[:200]


def _short(indices: list[int]) -> str:
    return str(list(indices)) if len(indices) <= 6 else f"[{indices[0]}, {indices[1]}, ..., {indices[-1]}]"


class AutoReader:
    """decord, and PyAV for the same file when decord fails to read it."""

    name = "auto"

    def __init__(self, path: str, first: DecordReader):
        self._path, self._decord, self.info = path, first, first.info

    def read(self, indices: list[int]) -> np.ndarray:
        try:
            return self._decord.read(indices)
        except DecodeError as first:
            try:
                fallback = PyAVReader(self._path)
            except DecodeError as second:
                raise DecodeError(f"{second} (decord: {first})", kind=second.kind) from None
            try:
                return fallback.read(indices)
            except DecodeError as second:
                raise DecodeError(f"{second} (decord: {first})", kind=second.kind) from None
            finally:
                fallback.close()

    def close(self) -> None:
        self._decord.close()


# Codecs whose seeking decord gets right (checked against PyAV's full decode in the tests). decord
# returns the wrong frames after a seek in MPEG-4 part 2 streams with B-frames (off by the B-frame
# delay), so `auto` decodes every other codec with PyAV.
DECORD_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mjpeg"})


def video_codec(path: str) -> str | None:
    """The first video stream's codec name from the container header, or None if unreadable."""
    import av

    try:
        with av.open(path) as c:
            stream = c.streams.video[0] if c.streams.video else None
            ctx = stream.codec_context if stream is not None else None
            return getattr(ctx, "name", None) if ctx is not None else None
    except Exception:
        return None


def open_video(path: str, backend: str = "auto"):
    """A reader (``.info``, ``.read(indices)``, ``.close()``).

    ``auto``: decord for the codecs in :data:`DECORD_CODECS` with PyAV as fallback (open or read
    failures), PyAV for everything else.
    """
    if backend == "decord":
        return DecordReader(path)
    if backend == "pyav" or _decord is None:
        return PyAVReader(path)
    codec = video_codec(path)
    if codec is not None and codec not in DECORD_CODECS:
        return PyAVReader(path)
    try:
        return AutoReader(path, DecordReader(path))
    except DecodeError as first:
        try:
            return PyAVReader(path)
        except DecodeError as second:
            kind = "zero_frames" if "zero_frames" in (first.kind, second.kind) else second.kind
            raise DecodeError(f"{second} (decord: {first})", kind=kind) from None


def decode_all(path: str) -> np.ndarray:
    """Every frame of a video with PyAV (the benchmark's baseline)."""
    import av

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


# ---------------------------------------------------------------------------------- images
def image_size(path: str) -> tuple[int, int]:
    """(height, width) from the image header (no decode)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
    except Exception as exc:
        raise DecodeError(f"cannot read the image: {exc}", kind="bad_image") from None
    return h, w


def read_image(path: str) -> np.ndarray:
    """An image as uint8 H x W x 3 RGB (alpha dropped, palettes and greyscale converted)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except Exception as exc:
        raise DecodeError(f"cannot decode the image: {exc}", kind="bad_image") from None


def resize_frames(frames_THWC: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic resize of every frame to ``height`` x ``width`` (no-op when already that size)."""
    if frames_THWC.shape[1] == height and frames_THWC.shape[2] == width:
        return np.ascontiguousarray(frames_THWC, dtype=np.uint8)
    from PIL import Image

    out = np.empty((frames_THWC.shape[0], height, width, 3), dtype=np.uint8)
    for t, frame in enumerate(frames_THWC):
        out[t] = np.asarray(Image.fromarray(frame).resize((width, height), Image.BICUBIC))
    return out


# ---------------------------------------------------------------------------------- caches
class FrameCache:
    """Thread-safe LRU of arrays within ``max_bytes`` (an array larger than the budget is not kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[Any, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> np.ndarray | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Any, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


_CACHES: dict[int, FrameCache] = {}
_PROBES: OrderedDict[tuple, Any] = OrderedDict()
_PROBE_MAX = 65536
_LOCK = threading.Lock()


def frame_cache(mib: int) -> FrameCache | None:
    """The process-wide frame cache with a ``mib`` MiB budget (``None`` when 0)."""
    if mib <= 0:
        return None
    with _LOCK:
        cache = _CACHES.get(mib)
        if cache is None:
            cache = _CACHES[mib] = FrameCache(mib << 20)
        return cache


def probe_get(key: tuple) -> Any:
    with _LOCK:
        value = _PROBES.get(key)
        if value is not None:
            _PROBES.move_to_end(key)
        return value


def probe_put(key: tuple, value: Any) -> None:
    with _LOCK:
        _PROBES[key] = value
        while len(_PROBES) > _PROBE_MAX:
            _PROBES.popitem(last=False)
