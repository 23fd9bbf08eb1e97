"""The frame-count and frame-size rules, as pure functions (no decoding here).

* :func:`smart_resize` -- Qwen's rule (qwen-vl-utils ``smart_resize``): both sides multiples of
  ``factor`` (= patch_size * merge_size: 28 for Qwen2.5-VL, 32 for Qwen3-VL), the area within
  ``[min_pixels, max_pixels]``, the aspect ratio kept. ``max_pixels`` wins over ``min_pixels``.
* :func:`smart_nframes` -- Qwen's ``smart_nframes`` for ``fps`` sampling: ``total / video_fps * fps``
  clamped to ``[ceil_tp(min_frames), floor_tp(max_frames)]`` and to the video length, floored to
  the temporal patch ``tp`` (2). Unlike Qwen it never fails on a 1-frame video: it returns ``tp``
  and :func:`evenly_spaced_indices` repeats the frame.
* :func:`dynamic_nframes` -- ``dynamic_sample``: the count is the video's own length (its frame
  count, e.g. ``meta.frame_cnts``) clamped to the same bounds, independent of ``fps``.
* :func:`evenly_spaced_indices` -- ``round(linspace(0, total - 1, n))`` as qwen-vl-utils and the
  Qwen3-VL video processor do; the last index is always ``total - 1``.
* :func:`plan_sizes` -- per-media frame counts and sizes that fit one sample's ``total_pixels``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_RATIO = 200


class BudgetError(ValueError):
    """The media of one sample cannot fit ``total_pixels`` even at the smallest size and count."""


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 4 * 28 * 28,
                 max_pixels: int = 16384 * 28 * 28) -> tuple[int, int]:
    """``(h, w)``: multiples of ``factor``, area within ``[min_pixels, max_pixels]``, aspect kept.

    Raises ``ValueError`` for an aspect ratio over 200 or a non-positive side.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}, got "
                         f"{max(height, width) / min(height, width):.1f}")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, floor_by_factor(height / beta, factor))
        w_bar = max(factor, floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def _bounds(min_frames: int, max_frames: int, temporal_patch: int) -> tuple[int, int]:
    lo = ceil_by_factor(min_frames, temporal_patch)
    hi = max(temporal_patch, floor_by_factor(max_frames, temporal_patch))
    return lo, hi


def smart_nframes(total_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                  max_frames: int = 768, temporal_patch: int = 2) -> int:
    """Frames to sample from a ``total_frames`` video at ``video_fps`` when sampling ``fps``."""
    if total_frames <= 0:
        raise ValueError(f"video has no frames (total_frames={total_frames})")
    lo, hi = _bounds(min_frames, max_frames, temporal_patch)
    n = total_frames / video_fps * fps if video_fps and video_fps > 0 else lo
    n = min(max(n, lo), hi, total_frames)
    return max(temporal_patch, floor_by_factor(n, temporal_patch))


def dynamic_nframes(length: int, min_frames: int = 4, max_frames: int = 768, temporal_patch: int = 2) -> int:
    """``dynamic_sample``: the video's length in frames clamped to the bounds, floored to the patch."""
    if length <= 0:
        raise ValueError(f"video has no frames (length={length})")
    lo, hi = _bounds(min_frames, max_frames, temporal_patch)
    return max(temporal_patch, floor_by_factor(min(max(length, lo), hi), temporal_patch))


def evenly_spaced_indices(total_frames: int, n: int) -> list[int]:
    """``n`` frame indices spread evenly over ``[0, total_frames - 1]`` (repeats when n > total)."""
    if total_frames <= 0 or n <= 0:
        raise ValueError(f"cannot sample {n} frames from {total_frames}")
    return [int(i) for i in np.linspace(0, total_frames - 1, n).round().astype(np.int64)]


def sample_frame_indices(total_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                         max_frames: int = 768, temporal_patch: int = 2) -> list[int]:
    """Indices of the frames sampled from a video (count by :func:`smart_nframes`, evenly spaced)."""
    n = smart_nframes(total_frames, video_fps, fps, min_frames, max_frames, temporal_patch)
    return evenly_spaced_indices(total_frames, n)


# ------------------------------------------------------------------------------- the budget
@dataclass(frozen=True)
class MediaSpec:
    """One media item of a sample before resizing: native size and wanted frame count."""

    kind: str  # "video" | "image"
    height: int
    width: int
    nframes: int = 1  # images: 1


@dataclass(frozen=True)
class MediaPlan:
    nframes: int
    height: int
    width: int


def sample_pixels(plans: list[MediaPlan]) -> int:
    """Pixels of a sample: summed over every frame of every media item."""
    return sum(p.nframes * p.height * p.width for p in plans)


def plan_sizes(specs: list[MediaSpec], *, factor: int, temporal_patch: int = 2, min_pixels: int, max_pixels: int,
               total_pixels: int, min_frames: int = 4) -> list[MediaPlan]:
    """Frame count and size per media item so that :func:`sample_pixels` <= ``total_pixels``.

    Order of concessions when the sample does not fit at ``max_pixels``: (1) one per-frame pixel
    cap shared by every frame of the sample (``total_pixels / frames``) down to ``min_pixels``;
    (2) fewer frames for the videos with the most, down to ``min_frames``; (3) further down to
    one temporal patch; (4) frames below ``min_pixels``, down to ``factor x factor``. Images keep
    their one frame. Raises :class:`BudgetError` when even that does not fit.
    """
    ns = [s.nframes if s.kind == "video" else 1 for s in specs]

    def sizes(cap: int) -> list[MediaPlan]:
        lo = min(min_pixels, cap) if cap >= min_pixels else factor * factor
        hi = min(max_pixels, cap)
        return [MediaPlan(n, *smart_resize(s.height, s.width, factor, lo, hi)) for s, n in zip(specs, ns)]

    plans = sizes(max_pixels)
    if sample_pixels(plans) <= total_pixels or not specs:
        return plans
    floor_min = max(temporal_patch, ceil_by_factor(min_frames, temporal_patch))
    for floor in (floor_min, temporal_patch):
        while sum(ns) * min_pixels > total_pixels:
            movable = [i for i, s in enumerate(specs) if s.kind == "video" and ns[i] - temporal_patch >= floor]
            if not movable:
                break
            i = max(movable, key=lambda j: (ns[j], j))
            ns[i] -= temporal_patch
        if sum(ns) * min_pixels <= total_pixels:
            break
    cap = total_pixels // sum(ns)
    for _ in range(200):  # smart_resize's rounding (and its factor-sized floor) may overshoot the cap
        if cap < 1:
            break
        plans = sizes(cap)
        used = sample_pixels(plans)
        if used <= total_pixels:
            return plans
        cap = min(cap - 1, int(cap * total_pixels / used))
    need = sum(ns) * factor * factor
    raise BudgetError(
        f"{len(specs)} media items with {sum(ns)} frames need at least {need} pixels "
        f"({factor}x{factor} per frame) but data.total_pixels is {total_pixels}"
    )
