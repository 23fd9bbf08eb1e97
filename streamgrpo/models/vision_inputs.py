"""How the vision of a :class:`~streamgrpo.models.batching.TrainBatch` reaches a Qwen-VL decoder.

The G rows of a group share one prompt and its visuals, so the log-probs run the vision encoder once
per group (:func:`encode_once`) and hand its outputs to the decoder by the path the installed
transformers release allows (:attr:`.capabilities.Capabilities.vision_once`):

* ``encoder_outputs``: the inner forward takes them as ``mm_encoder_outputs`` (transformers >= 5.2x)
  and scatters them into ``inputs_embeds`` itself.
* ``scatter``: a release without that keyword (5.17) would swallow it in ``**kwargs`` and run the
  decoder on the bare placeholder embeddings, blind to the video. :func:`scatter_forward` does what
  those releases' own forward does with pixels, from the precomputed features instead: embed the ids,
  ``masked_scatter`` the features at the image/video placeholder tokens, and for Qwen3-VL hand the
  deepstack features to the language model with ``visual_pos_masks``/``deepstack_visual_embeds``.
* ``per_row``: pixels repeated per sequence (:func:`pixels_per_sequence`), the encoder G times a group
  (once a group in the packed layout, whose sequences are groups).

All three give the same hidden states (tests/unit/models/test_transformers_range.py, on the lowest admitted
release too: ``make test-tf-low``). Only keywords the forward names are passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from streamgrpo.models.batching import TrainBatch
from streamgrpo.models.capabilities import ENCODER_OUTPUTS, PER_ROW, Capabilities, takes
from streamgrpo.models.vision_trunk import encoder_output

_PIXELS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
_VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
STAND_IN = "stand_in"
"""The key of :func:`encode_once`'s output for a stand-in's encoding (``TrainBatch.vision_stand_in``)."""


def _sequence_groups(batch: TrainBatch, seq_groups: Sequence[int] | None) -> list[int]:
    return batch.row_group.tolist() if seq_groups is None else list(seq_groups)


def encode_once(inner: nn.Module, batch: TrainBatch, seq_groups: Sequence[int] | None = None,
                sp: Any = None) -> dict[str, Any]:
    """Run the vision encoder once over the visuals of all groups; replicate the outputs per sequence.

    Returns ``{"image"|"video": encoder output}``, each output's ``pooler_output`` (and Qwen3-VL's
    ``deepstack_features``, per layer) a tuple with one entry per image/video in the order they occur
    in the flattened forward batch (sequence after sequence). ``seq_groups``: the group of each
    sequence; default one sequence per row. With ``batch.vision_cache`` a frozen trunk runs once per batch
    (:mod:`.vision_trunk`), split over the frames among the ranks of a sequence-parallel group ``sp``. Releases that return each deepstack layer as one tensor
    over all items (5.17) are split into items here, so the layout does not depend on the release.
    """
    encoded: dict[str, Any] = {}
    seqs = _sequence_groups(batch, seq_groups)
    members = {kind: [gi for gi, g in enumerate(batch.groups) if getattr(g, pix_key) is not None]
               for kind, (pix_key, _) in _PIXELS.items()}
    inputs = {kind: (torch.cat([getattr(batch.groups[gi], pix_key) for gi in members[kind]]),
                     torch.cat([getattr(batch.groups[gi], grid_key) for gi in members[kind]]))
              for kind, (pix_key, grid_key) in _PIXELS.items() if members[kind]}
    if batch.vision_stand_in and not inputs:
        return {STAND_IN: encoder_output(inner, "image", *_stand_in(inner, batch.input_ids.device), batch.vision_cache,
                                         sp)}
    if batch.one_vision_call and len(inputs) == 2:
        outputs = _one_call(inner, inputs, batch.vision_cache, sp)
    else:
        outputs = {kind: encoder_output(inner, kind, *inputs[kind], batch.vision_cache, sp) for kind in inputs}
    for kind, out in outputs.items():
        grid_key = _PIXELS[kind][1]
        if not isinstance(getattr(out, "pooler_output", None), (tuple, list)):
            raise TypeError(f"{type(inner).__name__}.get_{kind}_features returned no per-{kind} pooler_output tuple")
        # the items (images or videos) of each group, as index ranges into the encoder's tuples
        spans, start = {}, 0
        for gi in members[kind]:
            n = int(getattr(batch.groups[gi], grid_key).shape[0])
            spans[gi] = range(start, start + n)
            start += n
        order = [i for gi in seqs for i in spans.get(gi, ())]
        fields = dict(out.items())
        fields["pooler_output"] = tuple(out.pooler_output[i] for i in order)
        deep = _deepstack_items(out)
        if deep is not None:
            fields["deepstack_features"] = [tuple(layer[i] for i in order) for layer in deep]
        encoded[kind] = type(out)(**fields)
    return encoded


def _deepstack_items(out: Any) -> list | None:
    """Qwen3-VL's deepstack features per layer, one entry per item (5.17 returns a tensor over all items)."""
    deep = getattr(out, "deepstack_features", None)
    if deep is None:
        return None
    sizes = [int(p.shape[0]) for p in out.pooler_output]
    return [torch.split(layer, sizes) if isinstance(layer, Tensor) else layer for layer in deep]


def _stand_in(inner: nn.Module, device: torch.device) -> tuple[Tensor, Tensor]:
    """Pixels and grid of the smallest image the encoder takes (one merged token's patches, zeros). (No weight is read
    here: ZeRO-3 gathers a partitioned weight read outside its module's call.)"""
    vc = inner.config.vision_config
    merge, patch = int(vc.spatial_merge_size), int(vc.patch_size)
    width = int(getattr(vc, "in_channels", 3)) * int(vc.temporal_patch_size) * patch * patch
    return (torch.zeros((merge * merge, width), device=device),
            torch.tensor([[1, merge, merge]], dtype=torch.long, device=device))


def stand_in_zero(encoded: dict[str, Any], like: Tensor) -> Tensor:
    """``like`` plus zero times the stand-in's features (:func:`encode_once`), so that its encoder call's backward runs
    (ZeRO-3 gathers the trained heads' weights there too); ``like`` unchanged without a stand-in."""
    out = encoded.get(STAND_IN)
    if out is None:
        return like
    parts = [p.sum() for p in out.pooler_output] + [t.sum() for layer in (_deepstack_items(out) or []) for t in layer]
    return like + (torch.stack(parts).sum() * 0.0).to(like.dtype)


def _one_call(inner: nn.Module, inputs: dict[str, tuple[Tensor, Tensor]], cache: dict | None, sp: Any
              ) -> dict[str, Any]:
    """The images and the videos through the encoder in one call, its outputs cut into the two kinds'.

    DeepSpeed ZeRO-3 gathers each vision module's weights at each of its calls, collectively: with a call per kind,
    a rank whose micro-batch holds images and videos calls the encoder twice while a rank with videos only calls it
    once, and their collectives no longer match. A Qwen-VL image's pixels are laid out as a video of one temporal
    patch (the processor repeats the frame), and the trunk attends within an item, so the videos' call over the
    images followed by the videos gives each item's features; the heads' backward then runs once too."""
    pixels = torch.cat([inputs["image"][0], inputs["video"][0]])
    grids = torch.cat([inputs["image"][1], inputs["video"][1]])
    out = encoder_output(inner, "video", pixels, grids, cache, sp)
    n = int(inputs["image"][1].shape[0])
    deep = _deepstack_items(out)
    parts = {}
    for kind, items in (("image", slice(0, n)), ("video", slice(n, None))):
        fields = dict(out.items())
        fields["pooler_output"] = tuple(out.pooler_output[items])
        if deep is not None:
            fields["deepstack_features"] = [tuple(layer[items]) for layer in deep]
        parts[kind] = type(out)(**fields)
    return parts


def pixels_per_sequence(batch: TrainBatch, seq_groups: Sequence[int] | None = None,
                        forward: Any = None) -> dict[str, Tensor]:
    """Visual tensors with each sequence's group's visuals, concatenated in sequence order (the naive layout).

    ``forward``: only the keys its signature names (Qwen3-VL's takes no ``second_per_grid_ts``).
    """
    groups = [batch.groups[gi] for gi in _sequence_groups(batch, seq_groups)]
    out: dict[str, Tensor] = {}
    for key in _VISUAL_KEYS:
        parts = [getattr(g, key) for g in groups if getattr(g, key) is not None]
        if parts and (forward is None or takes(forward, key)):
            out[key] = torch.cat(parts)
    return out


def features_by_kind(cfg: Any, encoded: dict[str, Any], ids: Tensor, like: Tensor):
    """Per visual kind the encoder outputs hold: ``(kind, its placeholder tokens' mask over ids, its features in
    order on ``like``'s device and dtype, its deepstack layers or None)``; a count of features that is not the count
    of placeholder tokens is a ValueError."""
    for kind, token in (("image", cfg.image_token_id), ("video", cfg.video_token_id)):
        out = encoded.get(kind)
        if out is None:
            continue
        feats = torch.cat(out.pooler_output, dim=0).to(like.device, like.dtype)
        mask = ids == token
        n = int(mask.sum())
        if n != feats.shape[0]:
            raise ValueError(f"{kind} features and {kind} tokens do not match, tokens: {n}, features: {feats.shape[0]}")
        deep = getattr(out, "deepstack_features", None)
        yield kind, mask, feats, (None if deep is None else [torch.cat(layer, dim=0) for layer in deep])


def _deepstack_inputs(masks: dict[str, Tensor], deep: dict[str, list[Tensor]]) -> tuple[Tensor, list[Tensor]]:
    """``visual_pos_masks`` (B, L) and ``deepstack_visual_embeds`` (per layer, (visual tokens, H)),
    images and videos interleaved in token order, as the Qwen3-VL forward builds them."""
    if len(deep) == 1:
        (kind, layers), = deep.items()
        return masks[kind], layers
    visual = masks["image"] | masks["video"]
    image_at, video_at = masks["image"][visual], masks["video"][visual]
    joint = []
    for img, vid in zip(deep["image"], deep["video"]):
        layer = img.new_zeros(int(visual.sum()), img.shape[-1])
        layer[image_at] = img
        layer[video_at] = vid
        joint.append(layer)
    return visual, joint


def scatter_forward(inner: nn.Module, encoded: dict[str, Any], *, input_ids: Tensor, attention_mask: Tensor,
                    position_ids: Tensor, use_cache: bool = False) -> Any:
    """The inner model's forward from precomputed encoder outputs, without ``mm_encoder_outputs``.

    What the Qwen2.5-VL / Qwen3-VL forward does with pixels (transformers 5.17 to 5.24), with the
    features of :func:`encode_once` in place of its own encoder call: the placeholder tokens'
    embeddings replaced by the features in order, Qwen3-VL's deepstack features added by the language
    model at the visual positions. Returns the language model's output (``last_hidden_state``).
    """
    embeds = stand_in_zero(encoded, inner.get_input_embeddings()(input_ids))
    masks: dict[str, Tensor] = {}
    deep: dict[str, list[Tensor]] = {}
    for kind, mask, feats, layers in features_by_kind(inner.config, encoded, input_ids, embeds):
        embeds = embeds.masked_scatter(mask[..., None].expand_as(embeds), feats)
        masks[kind] = mask
        if layers is not None:
            deep[kind] = layers
    lm = inner.language_model
    kw: dict[str, Any] = dict(input_ids=None, inputs_embeds=embeds, attention_mask=attention_mask,
                              position_ids=position_ids)
    if takes(type(lm).forward, "use_cache"):
        kw["use_cache"] = use_cache
    if deep:
        kw["visual_pos_masks"], kw["deepstack_visual_embeds"] = _deepstack_inputs(masks, deep)
    return lm(**kw)


def decoder_hidden_states(inner: nn.Module, caps: Capabilities, batch: TrainBatch, inputs: dict[str, Any], *,
                          seq_groups: Sequence[int] | None = None, shared_vision: bool = True) -> Tensor:
    """Last hidden states of the inner model for ``inputs`` (ids, masks, positions of the sequences)
    with the vision of ``batch``: encoded once per group by ``caps.vision_once``, or per sequence.

    ``seq_groups``: the group of each sequence (default: one sequence per row of ``batch``).
    """
    path = caps.vision_once if shared_vision else PER_ROW
    if path == PER_ROW:
        return inner(**inputs, **pixels_per_sequence(batch, seq_groups, type(inner).forward)).last_hidden_state
    encoded = encode_once(inner, batch, seq_groups)
    if not encoded:
        return inner(**inputs).last_hidden_state
    # one_vision_call (ZeRO-3 on several ranks): the scatter path on every rank, a stand-in's too: ZeRO-3 gathers and
    # prefetches weights by each rank's order of module calls (the inner model's own call counts)
    if path == ENCODER_OUTPUTS and not batch.one_vision_call:
        return inner(**inputs, mm_encoder_outputs=encoded).last_hidden_state
    return scatter_forward(inner, encoded, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                           position_ids=inputs["position_ids"], use_cache=bool(inputs.get("use_cache", False))
                           ).last_hidden_state
