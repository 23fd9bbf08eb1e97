"""Vision features kept by video for the HF engine: a visual that returns (another epoch, another question
on the same video, T-GRPO's ordered prompt again) skips the vision tower.

Key: the visual's kind, the digest of the exact uint8 frames the processor was given (``MediaRef.digest``
where the visual has one, else computed here: the same ``xxh3_128``), and the item's patch grid ``(t, h, w)``.
The digest stands for the file, its decoder, the sampled frame indices and the resize (what
``data.max_frames``/``max_pixels`` decided); the grid for the processor's patching; an engine keeps one
processor. A shuffled T-GRPO copy has other frames, so another digest.

Value: the vision tower's output for that one item (the merged features and Qwen3-VL's deepstack features,
on the model's device), in a byte-bounded LRU (``rollout.vision_cache_mib``; the LRU is
:class:`~streamgrpo.data.decode.FrameCache`). A weight version that changes a vision-tower parameter empties
it (:meth:`~streamgrpo.engines.hf.HFEngine.load_weights` compares those tensors before copying them); one that
only trains the decoder keeps it.

The kept features reach the decoder as ``mm_encoder_outputs`` (the path of :mod:`streamgrpo.models.vision_inputs`),
so the cache works where the model's forward takes them (transformers 5.24; :mod:`.capabilities`); elsewhere
the pixels go to the forward as before and the engine says so once. The vision tower runs on the missing
items of a batch together, each distinct item once. Metrics: ``streamgrpo_vision_cache{result=hit|miss}``
(items) and ``streamgrpo_vision_cache_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from streamgrpo.data.decode import FrameCache
from streamgrpo.metrics import VISION_CACHE, VISION_CACHE_BYTES
from streamgrpo.wire import Visual
from streamgrpo.wire.media import frames_digest

KINDS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
"""Each visual kind's pixel and grid keys in a processor's output."""


@dataclass(frozen=True)
class Features:
    """The vision tower's output for one image or video."""

    pooled: Tensor  # (tokens, hidden): the merged features the decoder's placeholders get
    deepstack: tuple[Tensor, ...] | None  # Qwen3-VL: one (tokens, hidden) per deepstack layer
    output_cls: type  # the encoder output's class (rebuilt around the kept tensors)

    @property
    def nbytes(self) -> int:
        parts = [self.pooled, *(self.deepstack or ())]
        return sum(int(t.numel()) * t.element_size() for t in parts)


def visual_digest(v: Visual) -> str | None:
    """The digest of the frames the processor got: the reference's, else computed; None without frames."""
    if v.ref is not None and v.ref.digest:
        return v.ref.digest
    if v.frames is None:
        return None
    return frames_digest(v.frames)


def item_keys(visuals_per_prompt: Sequence[Sequence[Visual]], grids: Tensor, kind: str) -> list[tuple] | None:
    """The cache key of every ``kind`` item of a batch, in the batch's order (prompt after prompt, each
    prompt's visuals in order); None when the visuals do not match the grids (then nothing is cached)."""
    vs = [v for visuals in visuals_per_prompt for v in visuals if v.kind == kind]
    if len(vs) != int(grids.shape[0]):
        return None
    keys = []
    for v, grid in zip(vs, grids.tolist()):
        digest = visual_digest(v)
        if digest is None:
            return None
        keys.append((kind, digest, tuple(int(x) for x in grid)))
    return keys


def _split(out: Any, sizes: list[int]) -> list[Features]:
    """One encoder call's output as one :class:`Features` per item (Qwen3-VL's deepstack layers may come
    as one tensor over all items: split by the items' token counts)."""
    pooled = out.pooler_output
    if isinstance(pooled, Tensor):
        pooled = torch.split(pooled, sizes)
    deep = getattr(out, "deepstack_features", None)
    layers = None
    if deep is not None:
        tokens = [int(p.shape[0]) for p in pooled]
        layers = [torch.split(layer, tokens) if isinstance(layer, Tensor) else layer for layer in deep]
    return [Features(p.detach(), None if layers is None else tuple(layer[i].detach() for layer in layers), type(out))
            for i, p in enumerate(pooled)]


def _assemble(items: list[Features]) -> Any:
    """The encoder output of ``items`` in order, as the model's own encoder call would have returned it."""
    fields: dict[str, Any] = {"pooler_output": tuple(f.pooled for f in items)}
    if items[0].deepstack is not None:
        fields["deepstack_features"] = [tuple(f.deepstack[k] for f in items) for k in range(len(items[0].deepstack))]
    return items[0].output_cls(**fields)


class VisionFeatureCache:
    """Vision features by visual (module docstring), at most ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.lru = FrameCache(max_bytes)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    def clear(self) -> None:
        self.lru.clear()
        VISION_CACHE_BYTES.set(0)

    def encoder_outputs(self, inner: Any, batch: dict[str, Tensor],
                        visuals_per_prompt: Sequence[Sequence[Visual]]) -> dict[str, Any] | None:
        """``{kind: encoder output}`` for the visuals of a collated ``batch`` (what the forward takes as
        ``mm_encoder_outputs``), the vision tower run on the items not kept; None when the items cannot
        be keyed (the caller then passes the pixels)."""
        encoded: dict[str, Any] = {}
        for kind, (pix_key, grid_key) in KINDS.items():
            if batch.get(pix_key) is None:
                continue
            grids = batch[grid_key]
            keys = item_keys(visuals_per_prompt, grids, kind)
            if keys is None:
                return None
            found = [self.lru.get(k) for k in keys]
            VISION_CACHE.labels(result="hit").inc(sum(f is not None for f in found))
            missing = list(dict.fromkeys(k for k, f in zip(keys, found) if f is None))  # distinct, in order
            VISION_CACHE.labels(result="miss").inc(len(missing))
            if missing:
                computed = self._encode(inner, kind, batch[pix_key], grids, keys, missing)
                for key, feats in computed.items():
                    self.lru.put(key, feats)
                found = [f if f is not None else computed[k] for k, f in zip(keys, found)]
            encoded[kind] = _assemble(found)
        VISION_CACHE_BYTES.set(self.lru.nbytes)
        return encoded

    @staticmethod
    def _encode(inner: Any, kind: str, pixels: Tensor, grids: Tensor, keys: list[tuple],
                missing: list[tuple]) -> dict[tuple, Features]:
        """One vision-tower call over the first occurrence of each missing item."""
        patches = grids.prod(-1).tolist()
        chunks = torch.split(pixels, patches)
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        rows = [first[k] for k in missing]
        fn = inner.get_image_features if kind == "image" else inner.get_video_features
        out = fn(torch.cat([chunks[i] for i in rows]), grids[rows], return_dict=True)
        merge = int(getattr(inner.visual, "spatial_merge_size", 2)) ** 2
        return dict(zip(missing, _split(out, [patches[i] // merge for i in rows])))
