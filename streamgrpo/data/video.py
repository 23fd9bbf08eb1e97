"""Videos and images of a record -> :class:`~streamgrpo.wire.Visual` (resized uint8 frames).

The public rules (so users can predict token counts) are :func:`smart_resize` and
:func:`sample_frame_indices` (see :mod:`streamgrpo.data.sampling`). :func:`load_visuals` applies
them to one record:

1. per video: frame count from ``fps`` (Qwen's ``smart_nframes``) or, with ``dynamic_sample``,
   from the video's length (``meta.frame_cnts`` when given, else the decoded frame count), within
   ``min_frames``/``max_frames``, rounded to the temporal patch; indices evenly spaced;
2. per frame/image: size by ``smart_resize`` within ``min_pixels``/``max_pixels``;
3. the sample's ``total_pixels`` budget (pixels summed over every frame of every video and image)
   is shared out by :func:`~streamgrpo.data.sampling.plan_sizes`;
4. only the sampled frames are decoded (decord, PyAV fallback) and resized; a frame LRU cache
   (``data.frame_cache_mib``) serves repeats.

``meta`` overrides: ``fps``, ``min_frames``, ``max_frames``, ``dynamic_sample``, ``frame_cnts``,
``min_pixels``, ``max_pixels``, ``total_pixels``. Every failure is a :class:`DataError` naming the
record id and the file.

A video's ``Visual.fps`` is the source frame rate and ``frame_indices`` the sampled source frames;
the last sampled index is always the last frame, so ``total = frame_indices[-1] + 1`` (this is
what :func:`streamgrpo.data.prompts.processor_inputs` gives the processor as video metadata).

Every visual also carries its :class:`~streamgrpo.wire.MediaRef` (file, decoder, size, digest of the
pixels) so that it can travel by reference (``rollout.media``); :func:`decode_resized` is the one
decode path, used here and by the learner to resolve a reference.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from streamgrpo.config import DataConfig
from streamgrpo.data.decode import (
    DecodeError,
    FrameCache,
    VideoInfo,
    file_key,
    frame_cache,
    image_size,
    open_video,
    probe_get,
    probe_put,
    read_image,
    resize_frames,
)
from streamgrpo.data.records import DataError, Record, default_media_root, ref_path
from streamgrpo.data.sampling import (
    BudgetError,
    MediaPlan,
    MediaSpec,
    dynamic_nframes,
    evenly_spaced_indices,
    plan_sizes,
    sample_frame_indices,
    smart_nframes,
    smart_resize,
)
from streamgrpo.wire import MediaRef, Visual
from streamgrpo.wire.media import frames_digest

__all__ = [
    "DataError",
    "decode_resized",
    "load_visuals",
    "sample_frame_indices",
    "sampling_params",
    "smart_nframes",
    "smart_resize",
]

_FALLBACK_FPS = 24.0  # a video whose container has no frame rate (as transformers assumes)
DECODE_CHUNK = 32  # frames decoded at their native size at once (a 4K clip: ~0.8 GB), then resized
DECODE_BYTES = 512 << 20  # ...fewer when their RGB frames would hold more (an 8K frame: 100 MB)


def sampling_params(record: Record, cfg: DataConfig) -> dict[str, Any]:
    """The effective sampling parameters of a record: ``cfg`` with the record's ``meta`` overrides."""
    meta = record.meta or {}
    out: dict[str, Any] = {}
    for key in ("fps", "min_frames", "max_frames", "dynamic_sample", "min_pixels", "max_pixels", "total_pixels"):
        value = meta.get(key)
        out[key] = getattr(cfg, key) if value is None else value
    for lo, hi in (("min_frames", "max_frames"), ("min_pixels", "max_pixels")):
        if out[lo] > out[hi]:  # one bound overridden past the other: the record's value wins
            if meta.get(hi) is not None and meta.get(lo) is None:
                out[lo] = out[hi]
            else:
                out[hi] = out[lo]
    out["frame_cnts"] = meta.get("frame_cnts")
    return out


def _fail(record: Record, path: str, exc: Exception, kind: str | None = None) -> DataError:
    return DataError(record.id, path, str(exc), kind=kind or getattr(exc, "kind", "unreadable_video"))


def _probe(kind: str, path: str, backend: str, readers: dict[str, Any]) -> tuple[tuple, Any]:
    """(file key, VideoInfo or (h, w)); opens the video (kept in ``readers``) when not cached."""
    key = file_key(path)
    info = probe_get((kind, backend, *key))
    if info is None:
        if kind == "video":
            readers[path] = open_video(path, backend)
            info = readers[path].info
        else:
            info = image_size(path)
        probe_put((kind, backend, *key), info)
    return key, info


def load_visuals(record: Record, cfg: DataConfig, factor: int, temporal_patch: int = 2) -> list[Visual]:
    """The record's videos and images as :class:`Visual`, in placeholder order (see module doc).

    ``factor`` is the processor's ``patch_size * merge_size`` and ``temporal_patch`` its
    ``temporal_patch_size`` (:func:`streamgrpo.data.prompts.vision_factors` reads both).
    """
    params = sampling_params(record, cfg)
    media = record.media()
    readers: dict[str, Any] = {}
    try:
        return _load(record, cfg, params, media, readers, factor, temporal_patch)
    finally:
        for reader in readers.values():
            reader.close()


def _load(record: Record, cfg: DataConfig, params: dict[str, Any], media: list[tuple[str, str]],
          readers: dict[str, Any], factor: int, temporal_patch: int) -> list[Visual]:
    keys, infos, indices, specs = _probe_media(record, cfg, params, media, readers, temporal_patch)
    plans = _plan_media(record, media, specs, params, factor, temporal_patch)
    cache = frame_cache(cfg.frame_cache_mib)
    root = default_media_root(cfg)  # once per record: what references are relative to
    return [_visual(record, cfg, item, key, info, idx, plan, readers, cache, root)
            for item, key, info, idx, plan in zip(media, keys, infos, indices, plans)]


def _probe_media(record: Record, cfg: DataConfig, params: dict[str, Any], media: list[tuple[str, str]],
                 readers: dict[str, Any], temporal_patch: int) -> tuple[list, list, list, list[MediaSpec]]:
    """Probe every medium: its file key, info, frame indices before the budget and :class:`MediaSpec`."""
    keys, infos, indices, specs = [], [], [], []
    video_no = 0
    for kind, path in media:
        key, info = _probe_file(record, kind, path, cfg.video_backend, readers)
        keys.append(key)
        infos.append(info)
        if kind == "image":
            h, w = info
            indices.append([0])
            specs.append(MediaSpec("image", h, w, 1))
            continue
        assert isinstance(info, VideoInfo)
        try:
            n = _video_nframes(info, params, video_no, temporal_patch)
        except ValueError as exc:
            raise _fail(record, path, exc, "zero_frames") from None
        video_no += 1
        indices.append(evenly_spaced_indices(info.total_frames, n))
        specs.append(MediaSpec("video", info.height, info.width, n))
    return keys, infos, indices, specs


def _probe_file(record: Record, kind: str, path: str, backend: str, readers: dict[str, Any]) -> tuple[tuple, Any]:
    """:func:`_probe` with its failures as the record's :class:`DataError`."""
    if not os.path.isfile(path):
        if os.path.exists(path):  # a FIFO, a device or a folder: reading it would block or never end
            raise DataError(record.id, path, f"{kind} path is not a regular file", kind="not_a_file")
        raise DataError(record.id, path, f"{kind} file not found", kind="missing_file")
    try:
        return _probe(kind, path, backend, readers)
    except DecodeError as exc:
        raise _fail(record, path, exc) from None
    except OSError as exc:
        raise _fail(record, path, exc, "missing_file") from None


def _video_nframes(info: VideoInfo, params: dict[str, Any], video_no: int, temporal_patch: int) -> int:
    """Frames to sample from the record's ``video_no``-th video before the pixel budget (pure)."""
    if params["dynamic_sample"]:
        cnts = params["frame_cnts"]
        length = cnts[video_no] if cnts else info.total_frames
        n = dynamic_nframes(length, params["min_frames"], params["max_frames"], temporal_patch)
        return min(n, max(temporal_patch, info.total_frames - info.total_frames % temporal_patch))
    return smart_nframes(info.total_frames, info.fps, params["fps"], params["min_frames"],
                         params["max_frames"], temporal_patch)


def _plan_media(record: Record, media: list[tuple[str, str]], specs: list[MediaSpec], params: dict[str, Any],
                factor: int, temporal_patch: int) -> list[MediaPlan]:
    """:func:`plan_sizes` under the record's pixel budget, its failures as :class:`DataError`."""
    try:
        return plan_sizes(specs, factor=factor, temporal_patch=temporal_patch, min_pixels=params["min_pixels"],
                          max_pixels=params["max_pixels"], total_pixels=params["total_pixels"],
                          min_frames=params["min_frames"])
    except BudgetError as exc:
        raise DataError(record.id, record.source, str(exc), kind="budget") from None
    except ValueError as exc:  # aspect ratio over 200
        bad = next((p for (_k, p), s in zip(media, specs) if max(s.height, s.width) > 200 * min(s.height, s.width)),
                   record.source)
        raise DataError(record.id, bad, str(exc), kind="bad_image") from None


def _visual(record: Record, cfg: DataConfig, item: tuple[str, str], key: tuple, info: Any, idx: list[int],
            plan: MediaPlan, readers: dict[str, Any], cache: FrameCache | None, root: str) -> Visual:
    """One medium decoded (or taken from the frame cache) at its planned size."""
    kind, path = item
    if kind == "video" and plan.nframes != len(idx):  # the budget took frames away
        idx = evenly_spaced_indices(info.total_frames, plan.nframes)
    ckey = (*key, kind, tuple(idx), plan.height, plan.width)
    frames = cache.get(ckey) if cache is not None else None
    if frames is None:
        frames = _read_frames(record, cfg, item, idx, plan, readers)
        if cache is not None:
            cache.put(ckey, frames)
    named = ref_path(path, cfg, root)
    ref = None if named is None else MediaRef(path=named, height=plan.height, width=plan.width,
                                              digest=frames_digest(frames), decoder=cfg.video_backend)
    if kind == "image":
        return Visual(kind="image", frames=frames, fps=0.0, frame_indices=np.zeros(0, dtype=np.int32), ref=ref)
    fps = info.fps if info.fps > 0 else _FALLBACK_FPS
    return Visual(kind="video", frames=frames, fps=float(fps), frame_indices=np.asarray(idx, dtype=np.int32), ref=ref)


def decode_resized(kind: str, path: str, indices: list[int], height: int, width: int, backend: str,
                   readers: dict[str, Any] | None = None) -> np.ndarray:
    """The frames ``indices`` of a video (an image: its one frame) decoded and resized to ``height`` x
    ``width``: what a generator feeds its model, and what the learner decodes again for a reference.
    ``readers`` keeps open videos by path (closed by the caller). Frames are decoded :data:`DECODE_CHUNK`
    at a time (fewer for large frames: :func:`decode_chunk`), so the memory a call needs is bounded by its
    output and :data:`DECODE_BYTES`, whatever the source's resolution.
    Raises DecodeError or OSError."""
    if kind == "image":
        return resize_frames(read_image(path)[None], height, width)
    readers = {} if readers is None else readers
    if path not in readers:
        readers[path] = open_video(path, backend)
    info = readers[path].info
    chunk = decode_chunk(info.height, info.width)
    if len(indices) <= chunk:
        return resize_frames(readers[path].read(indices), height, width)
    out = np.empty((len(indices), height, width, 3), dtype=np.uint8)  # at most `chunk` frames at full size
    for i in range(0, len(indices), chunk):
        part = indices[i:i + chunk]
        out[i:i + len(part)] = resize_frames(readers[path].read(part), height, width)
    return out


def decode_chunk(height: int, width: int) -> int:
    """Frames decoded at their native ``height`` x ``width`` at once: :data:`DECODE_CHUNK`, fewer when they
    would hold more than :data:`DECODE_BYTES` (at least one)."""
    per_frame = max(1, int(height) * int(width) * 3)
    return max(1, min(DECODE_CHUNK, DECODE_BYTES // per_frame))


def _read_frames(record: Record, cfg: DataConfig, item: tuple[str, str], idx: list[int], plan: MediaPlan,
                 readers: dict[str, Any]) -> np.ndarray:
    kind, path = item
    try:
        return decode_resized(kind, path, idx, plan.height, plan.width, cfg.video_backend, readers)
    except DecodeError as exc:
        raise _fail(record, path, exc) from None
    except OSError as exc:  # removed or unreadable since it was probed
        raise _fail(record, path, exc, "missing_file") from None


