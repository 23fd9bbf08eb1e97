"""A frozen vision tower off the training graph: its trunk runs once per batch, without gradients, shared.

With ``model.tune_mm_vision: false`` the vision tower's *trunk* (patch and position embeddings, the
blocks) never trains; only its *heads* (the merger into the decoder's width and Qwen3-VL's deepstack
mergers, ``model.tune_mm_mlp``) may. A learner step still ran the trunk in every forward that wanted
vision features: the reference model's (``loss.beta > 0``), the policy's, and each probe of
``learner.max_update_kl``, each time the whole tower. :func:`encoder_output` runs the trunk once per
:class:`~streamgrpo.models.batching.TrainBatch` (its ``vision_cache``; the learner gives each micro-batch
one), under ``no_grad`` and so outside activation checkpointing (nothing to recompute in backward), and
keeps the outputs of the blocks the heads read (the last block; Qwen3-VL's deepstack layers too). Every
later forward of the batch, by any model whose trunk has the same weights, replays them through its own
heads: the model's own vision forward runs with each block replaced by a stand-in that returns the kept
output (or passes its input on) and the patch embedding by one that returns zeros (the stand-ins never
read it), so positions, window order and the mergers are the installed transformers release's own code.
A model whose heads are frozen too (LoRA; ``tune_mm_mlp: false``) reuses the first forward's features
outright.

Which models share: the key is the trunk's parameter dtype and device and the autocast state, so the
policy and a frozen reference copy of it share when both store the trunk alike (``learner.bf16``: both
bf16), and LoRA's reference (the same module, adapters off) always does. The values are the ones the
uncached forward computes (same kernels on the same inputs): no switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamgrpo.models.seq_split import split_frames
from streamgrpo.models.sp_group import gate

_HEADS = ("merger", "deepstack_merger_list")


def _trunk_params(visual: nn.Module) -> Iterator[nn.Parameter]:
    for name, p in visual.named_parameters():
        if not name.startswith(_HEADS):
            yield p


def trunk_frozen(visual: nn.Module) -> bool:
    """Whether nothing in ``visual``'s trunk (all but the mergers) trains, and it has blocks to replay."""
    blocks = getattr(visual, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks) or getattr(visual, "patch_embed", None) is None:
        return False
    return not any(p.requires_grad for p in _trunk_params(visual))


def heads_frozen(visual: nn.Module) -> bool:
    return not any(p.requires_grad for p in visual.parameters())


def _kept_layers(visual: nn.Module) -> list[int]:
    """The blocks whose outputs the heads read: Qwen3-VL's deepstack layers and the last one."""
    deep = [int(i) for i in getattr(visual, "deepstack_visual_indexes", None) or ()]
    return sorted({*deep, len(visual.blocks) - 1})


def trunk_key(visual: nn.Module) -> tuple:
    """What two trunks must share to give the same outputs (their weights are the checkpoint's, frozen)."""
    p = next(_trunk_params(visual))
    dev = p.device.type
    cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return (p.dtype, str(p.device), cast, len(visual.blocks))


@dataclass
class TrunkRun:
    """One trunk pass: the kept block outputs (no gradient) and the features of the forward that ran it."""

    outputs: dict[int, Tensor]
    encoded: Any
    heads_frozen: bool
    pixels: Tensor  # held: the cache's inputs stay alive (and their storage unreused) with it


class _Replay(nn.Module):
    """Stands in for a vision block: returns the kept output of the real block, else its input unchanged."""

    def __init__(self, out: Tensor | None):
        super().__init__()
        self.out = out

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states if self.out is None else self.out


class _NoPatches(nn.Module):
    """Stands in for the patch embedding while blocks are replayed: zeros of its output's shape and dtype."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, pixels: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return torch.zeros((pixels.shape[0], self.width), dtype=self.dtype, device=pixels.device)


def _patch_width(visual: nn.Module) -> tuple[int, torch.dtype]:
    proj = visual.patch_embed.proj
    return int(proj.out_channels), proj.weight.dtype


@contextlib.contextmanager
def _replaying(visual: nn.Module, outputs: dict[int, Tensor]) -> Iterator[None]:
    blocks, patch_embed = visual.blocks, visual.patch_embed
    visual.blocks = nn.ModuleList(_Replay(outputs.get(i)) for i in range(len(blocks)))
    visual.patch_embed = _NoPatches(*_patch_width(visual))
    try:
        yield
    finally:
        visual.blocks, visual.patch_embed = blocks, patch_embed


def _capture(visual: nn.Module, run: Callable[[], Any]) -> tuple[dict[int, Tensor], Any]:
    kept: dict[int, Tensor] = {}
    hooks = [visual.blocks[i].register_forward_hook(lambda _m, _a, out, i=i: kept.__setitem__(i, out))
             for i in _kept_layers(visual)]
    try:
        with torch.no_grad():
            encoded = run()
    finally:
        for h in hooks:
            h.remove()
    return {i: (t[0] if isinstance(t, tuple) else t).detach() for i, t in kept.items()}, encoded


def encoder_output(inner: nn.Module, kind: str, pixels: Tensor, grids: Tensor, cache: dict | None,
                   sp: Any = None) -> Any:
    """``inner.get_{kind}_features(pixels, grids, return_dict=True)``, the trunk once per ``cache`` (see the
    module docstring); without a cache, or with a trunk that trains, the plain call. ``sp``: a sequence-parallel
    group (:class:`~streamgrpo.models.ulysses.SPGroup`) whose ranks hold the same batch: each runs the trunk over
    its share of the frames and the kept outputs are gathered (:func:`_split_trunk`)."""
    fn = inner.get_image_features if kind == "image" else inner.get_video_features

    def call() -> Any:
        return fn(pixels, grids, return_dict=True)

    visual = getattr(inner, "visual", None)
    if cache is None or visual is None or not trunk_frozen(visual):
        return call()
    key = (kind, trunk_key(visual))
    run = cache.get(key)
    frozen = heads_frozen(visual)
    if run is None and sp is not None and sp.active:
        run = cache[key] = TrunkRun(_split_trunk(visual, fn, pixels, grids, sp), None, frozen, pixels)
        with torch.no_grad():
            run.encoded = _replay(visual, run, call)  # the heads over the whole pass
        return run.encoded if frozen or not torch.is_grad_enabled() else _replay(visual, run, call)
    if run is None:
        outputs, encoded = _capture(visual, call)
        run = cache[key] = TrunkRun(outputs, encoded, frozen, pixels)
        return encoded if frozen or not torch.is_grad_enabled() else _replay(visual, run, call)
    if frozen and run.heads_frozen:
        return run.encoded
    return _replay(visual, run, call)


def _split_trunk(visual: nn.Module, fn: Callable[..., Any], pixels: Tensor, grids: Tensor, sp: Any
                 ) -> dict[int, Tensor]:
    """The kept block outputs of the whole pass, each rank of ``sp`` having run the trunk over its run of temporal
    patches (:func:`~streamgrpo.models.seq_split.split_frames`: the trunk attends within a temporal patch, and
    Qwen2.5-VL's window order is frame-major, so the ranks' outputs in rank order are the whole pass's), then
    gathered over the group (padded to the largest share)."""
    grid_list = [tuple(int(v) for v in g) for g in grids.tolist()]
    shares = split_frames(grid_list, sp.world)
    starts = torch.tensor([0] + [t * h * w for t, h, w in grid_list]).cumsum(0).tolist()
    mine = shares[sp.rank]
    kept = _kept_layers(visual)
    # a rank with no frames (fewer temporal patches than ranks: an image) runs the trunk over the first temporal
    # patch all the same and keeps nothing: DeepSpeed ZeRO-3 gathers each block's weights at its call, collectively,
    # so every rank of the group calls the trunk alike (and that rank would wait for its peers anyway)
    run = mine or [(0, 0, 1, 0)]
    rows = torch.cat([torch.arange(starts[i] + first * grid_list[i][1] * grid_list[i][2],
                                   starts[i] + (first + n) * grid_list[i][1] * grid_list[i][2])
                      for i, first, n, _ in run]).to(pixels.device)
    sub_grids = torch.tensor([[n, grid_list[i][1], grid_list[i][2]] for i, _, n, _ in run],
                             dtype=grids.dtype, device=grids.device)
    sub_pixels = pixels.index_select(0, rows)
    outputs, _ = _capture(visual, lambda: fn(sub_pixels, sub_grids, return_dict=True))
    if not mine:
        outputs = {}
    width = _patch_width(visual)[0]
    _, _, cast, _ = trunk_key(visual)
    dtype = cast or next(_trunk_params(visual)).dtype  # what the blocks give (a rank without frames has none)
    sizes = [sum(p for *_, p in share) for share in shares]
    whole: dict[int, Tensor] = {}
    for layer in kept:
        local = outputs.get(layer, pixels.new_zeros((0, width), dtype=dtype)).to(dtype)
        padded = local.new_zeros((max(sizes), width))
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(sp.world)]
        gate(sp)
        dist.all_gather(gathered, padded, group=sp.group)
        whole[layer] = torch.cat([g[:n] for g, n in zip(gathered, sizes)])
    return whole


def _replay(visual: nn.Module, run: TrunkRun, call: Callable[[], Any]) -> Any:
    with _replaying(visual, run.outputs):
        return call()
