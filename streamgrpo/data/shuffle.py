"""Shuffled frames: the same sampled frames of each video in a random order (images untouched).

Used by the temporal-reliance probe (``streamgrpo eval --shuffle-frames``) and by T-GRPO's
contrast group (``rollout.temporal_contrast``): a model that answers as well on shuffled frames
does not use their order. Pure: a seeded ``numpy`` generator in, new :class:`~streamgrpo.wire.Visual`
objects out (the inputs are not modified).
"""

from __future__ import annotations

import numpy as np

from streamgrpo.wire import Visual


def shuffled_order(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of ``range(n)`` that is not the identity when ``n >= 2``."""
    if n < 2:
        return np.arange(n)
    while True:
        order = rng.permutation(n)
        if (order != np.arange(n)).any():
            return order


def shuffle_visuals(visuals: list[Visual], rng: np.random.Generator) -> list[Visual]:
    """Each video's frames permuted within that video; images as they are.

    ``frame_indices`` stay in their ascending order: they label positions, and a model that reads
    timestamps from them (Qwen3-VL writes them into the prompt) would otherwise be told the true order.
    """
    out = []
    for v in visuals:
        if v.kind != "video" or v.frames.shape[0] < 2:
            out.append(v)
            continue
        order = shuffled_order(v.frames.shape[0], rng)
        out.append(Visual(v.kind, np.ascontiguousarray(v.frames[order]), v.fps, v.frame_indices))
    return out


def has_video(visuals: list[Visual]) -> bool:
    """Whether shuffling changes anything: at least one video of two frames or more."""
    return any(v.kind == "video" and v.frames.shape[0] >= 2 for v in visuals)
