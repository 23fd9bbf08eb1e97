"""Vision attention in one call per block: the chunks of a vision pass packed into one batched kernel call.

The Qwen-VL vision towers attend within chunks of the patch sequence, given as ``cu_seqlens``: Qwen2.5-VL's
windowed blocks within each window (112 pixels: 128 windows a block at 16 x 448² video), its full-attention
blocks (``fullatt_block_indexes``) and every Qwen3-VL block within each image or frame pair. With
flash-attention transformers makes one variable-length call per block; with sdpa or eager it splits q/k/v
and calls the kernel once per chunk (a launch, a few small ops and a host sync each).

Here the chunks go to the kernel in one call: each is padded to the longest with a key-padding mask (the
ragged edge windows are shorter; equal-size windows need no mask and no copy, q/k/v are reshaped in place).
It is installed as a transformers attention function (``AttentionInterface.register``), named on the vision
tower's config only: transformers then takes its variable-length branch (the one flash-attention gets: any
implementation whose name contains ``flash``), so q/k/v, rotary embeddings, the output projection, windows
and positions are the installed release's own code, and the kernel itself is transformers' own sdpa or the
model's own eager function, now on a batch of chunks. Where flash_attention_2 is the implementation,
nothing is installed: flash-attention's varlen kernel already is one call. (Replacing each attention
module's forward instead would copy transformers' q/k/v and rotary code into ours; a release that stopped
routing ``flash`` names to the varlen branch would call this function per chunk without ``cu_seqlens``,
which it passes straight to the kernel: the same values, unpacked, and the count test failing.)

Always on for sdpa and eager (:func:`install`, from :func:`~streamgrpo.models.loading.load_model`): the values
are the per-chunk path's within float rounding (the padded keys get exactly zero weight), tested on both
architectures, with the trunk frozen and with the tower training (the gathers are differentiable).

Memory: a call's padded attention scores ``chunks x heads x L²`` are kept at most :data:`PAD_BUDGET` (4)
times the exact ``heads x Σ len²`` of its chunks (and so its padded q/k/v/output at most 4x the real tokens:
``chunks x L <= 4 Σ len``); chunks that would exceed it (a large image with many small ones) go to another
call, longest first. 4 is what keeps every windowed block of any one video or image size a single call: a
frame's windows are at most 4 times its full windows (2 x 2 windows, three of them edge slivers, is the
worst: a 140-pixel frame). At real sizes it is close to 1 (16 x 448²: 128 equal windows, no padding, no
copy; a 336 x 504 frame: 1.18).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

PAD_BUDGET = 4.0
"""A packed call's padded scores are at most this many times its chunks' exact scores."""

NAMES = {"sdpa": "streamgrpo_packed_sdpa_flash_api", "eager": "streamgrpo_packed_eager_flash_api"}
"""The registered names, per kernel they pack (``flash`` in the name: transformers passes ``cu_seqlens``)."""

_PLAN = "_streamgrpo_packing"  # the plan is kept on the cu_seqlens tensor: one host sync per pass, not per block


def buckets(lengths: list[int], budget: float = PAD_BUDGET) -> list[list[int]]:
    """Chunk indices grouped into calls, longest chunk first: a call takes the next chunk while its padded
    scores ``count x L²`` stay within ``budget`` x the exact ``Σ len²``. Empty chunks are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    longest = exact = 0
    for i in order:
        n = lengths[i]
        if out and (len(out[-1]) + 1) * longest**2 <= budget * (exact + n * n):
            out[-1].append(i)
            exact += n * n
        else:
            out.append([i])
            longest, exact = n, n * n
    return out


@dataclass(frozen=True)
class Call:
    """One packed kernel call: ``count`` chunks padded to ``length`` tokens."""

    count: int
    length: int
    gather: Tensor | None
    """(count x length,) the token in each padded slot (a pad: its chunk's first token); None: in order."""
    keep: Tensor | None
    """(count, length) bool, the real slots; None: no padding."""


@dataclass(frozen=True)
class Plan:
    calls: tuple[Call, ...]
    scatter: Tensor | None
    """(tokens,) where each token's output is in the calls' outputs, concatenated; None: in order."""


def plan(lengths: list[int], device: torch.device | str = "cpu", budget: float = PAD_BUDGET) -> Plan:
    """The calls for chunks of ``lengths`` tokens, laid end to end (pure; the index tensors on ``device``)."""
    groups = buckets(lengths, budget)
    if len(groups) == 1 and len({lengths[i] for i in groups[0]}) == 1 and all(lengths):
        return Plan((Call(len(lengths), lengths[0], None, None),), None)  # equal chunks: reshape, nothing copied
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    lens = torch.tensor(lengths)
    scatter = torch.empty(int(lens.sum()), dtype=torch.long)
    calls, base = [], 0
    for g in groups:
        idx = torch.tensor(g)
        length, s, n = lengths[g[0]], starts[idx, None], lens[idx, None]
        j = torch.arange(length)[None]
        keep = j < n
        pos = s + j
        slots = base + torch.arange(len(g) * length).view(len(g), length)
        scatter[pos[keep]] = slots[keep]
        ragged = not bool(keep.all())
        calls.append(Call(len(g), length, torch.where(keep, pos, s).flatten().to(device),
                          keep.to(device) if ragged else None))
        base += len(g) * length
    return Plan(tuple(calls), scatter.to(device))


def plan_for(cu_seqlens: Tensor) -> Plan:
    """The :class:`Plan` of a pass's ``cu_seqlens``, made once and kept on the tensor (every block of the
    pass, and its recompute under activation checkpointing, gets the same tensor)."""
    got = getattr(cu_seqlens, _PLAN, None)
    if got is None:
        got = plan((cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), cu_seqlens.device)
        setattr(cu_seqlens, _PLAN, got)
    return got


def _inner(kind: str, module: nn.Module):
    if kind == "eager":  # the model's own eager function, as its per-chunk path would call
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def _mask(keep: Tensor | None, kind: str, dtype: torch.dtype) -> Tensor | None:
    if keep is None:
        return None
    keep = keep[:, None, None, :]
    if kind == "sdpa":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _chunks(x: Tensor, call: Call) -> Tensor:
    """(1, heads, tokens, dim) -> (count, heads, length, dim)."""
    x = x[0] if call.gather is None else x[0].index_select(1, call.gather)
    return x.unflatten(1, (call.count, call.length)).transpose(0, 1)


def _packed_attention(kind: str):
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
        cu = kwargs.pop("cu_seq_lens_q", None)
        for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
            kwargs.pop(k, None)
        inner = _inner(kind, module)
        if cu is None or attention_mask is not None or query.shape[0] != 1:  # not a packed vision sequence
            return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                         is_causal=False, **kwargs)
        p = plan_for(cu)
        heads, dim = query.shape[1], value.shape[-1]
        outs = []
        for call in p.calls:
            out, _ = inner(module, _chunks(query, call), _chunks(key, call), _chunks(value, call),
                           _mask(call.keep, kind, query.dtype), scaling=scaling, dropout=dropout, is_causal=False,
                           **kwargs)  # (count, length, heads, dim)
            outs.append(out.reshape(call.count * call.length, heads, dim))
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)
        return (flat if p.scatter is None else flat.index_select(0, p.scatter)).unsqueeze(0), None

    attention.__name__ = f"packed_{kind}_attention"
    return attention


_REGISTERED = False
_LOGGED: set[str] = set()


def register() -> None:
    """Register the packed kernels with transformers (once per process; a copied model finds them too)."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        for kind, name in NAMES.items():
            AttentionInterface.register(name, _packed_attention(kind))
        _REGISTERED = True


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The Qwen-VL vision tower of a ``*ForConditionalGeneration`` (or its inner model), if it has one."""
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    return visual if getattr(visual, "config", None) is not None else None


def install(model: nn.Module, on: bool = True) -> str | None:
    """Pack the vision tower's attention (``on``), or restore the per-chunk kernel it had (``on=False``);
    returns the vision tower's implementation now, None without a vision tower. Only sdpa and eager are
    packed: flash-attention already makes one varlen call per block, other kernels are left as they are."""
    visual = vision_tower(model)
    if visual is None:
        return None
    cfg = visual.config
    now = cfg._attn_implementation
    packed_from = {v: k for k, v in NAMES.items()}
    if on and now in NAMES:
        register()
        cfg._attn_implementation = NAMES[now]
        if now not in _LOGGED:
            _LOGGED.add(now)
            log.info("vision attention: %s, the chunks of each block packed into one call", now)
    elif not on and now in packed_from:
        cfg._attn_implementation = packed_from[now]
    return cfg._attn_implementation
