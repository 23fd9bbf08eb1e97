"""Sequence parallelism of the decoder (``learner.sequence_parallel: N``), DeepSpeed-Ulysses style.

The N ranks of a sequence-parallel group hold the same batch; each runs the decoder over its columns of every
sequence (:mod:`streamgrpo.models.seq_split`). Everything but attention is per token. Attention exchanges heads
for tokens: q, k and v of the local columns (all heads) go to the ranks all-to-all, each rank attends with 1/N of
the heads over the whole sequence (the installed kernel, sdpa or eager, with the causal or packed block mask of the
whole sequence), and a second all-to-all brings the outputs back to their columns, all heads. Activations of a
decoder layer are 1/N of a rank's; each attention kernel sees the whole sequence for its heads.

How it is put in: an attention function registered with transformers (``AttentionInterface``, as
:mod:`streamgrpo.models.vision_attention` does for the vision tower), named on the text config, so q/k/v, rotary
(from the local m-RoPE positions), the projections and activation checkpointing are the installed release's code;
the all-to-alls are ``torch.distributed.all_to_all_single`` in a differentiable function (the backward is the
reverse exchange; ``torch.distributed.nn.functional``'s is deprecated). q, k and v travel in one exchange; key/value heads fewer than N are repeated first. The function
learns of the group from the attention mask it receives: :func:`sp_mask` hangs the group and the whole sequence's
mask on the tensor the language model passes to every layer unchanged (a 4D mask is taken as given), so the
recompute of a checkpointed layer in backward finds it too; without it the function is the plain kernel.

The embeddings: every rank embeds its columns' ids and scatters the vision features that land in them (the
features of the whole batch: the vision pass is the group's, :mod:`streamgrpo.models.vision_trunk`), Qwen3-VL's
deepstack features likewise. The log-probs: each rank computes those of the completion tokens its columns predict,
and :func:`sum_over_group` adds the ranks' (B, T) tensors (forward: an all-reduce; backward: the identity, since
every rank computes the same loss from the sum), so the loss and the gradient of every parameter, summed over the
group's ranks, are one rank's without sequence parallelism.

DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` does the same exchange around a local attention
module; it is not used because the torch backend must run without DeepSpeed and because transformers' attention
interface already gives the one place to put it (verl patches the flash-attention forward the same way).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamgrpo.models.batching import prepare_batch
from streamgrpo.models.packing import PAD_SEGMENT, block_mask, pack_batch
from streamgrpo.models.seq_split import SeqSplit
from streamgrpo.models.sp_group import SPGroup, gate
from streamgrpo.models.vision_inputs import _deepstack_inputs, encode_once, features_by_kind, stand_in_zero

NAMES = {"sdpa": "streamgrpo_ulysses_sdpa", "eager": "streamgrpo_ulysses_eager"}
"""The registered attention names, per kernel they wrap."""

_ATTR = "_streamgrpo_ulysses"


# ------------------------------------------------------------------------------------------ exchanges
class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of equal blocks; the backward sends the gradients back the same way. Each
    exchange is gated (:func:`~streamgrpo.models.sp_group.gate`) once its buffers exist."""

    @staticmethod
    def forward(ctx, x: Tensor, sp: SPGroup) -> Tensor:
        ctx.sp = sp
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous as x: the exchange reads and writes the memory in order
        gate(sp)
        dist.all_to_all_single(out, x, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()  # a permuted view's gradient may come strided
        out = torch.empty_like(grad)
        gate(ctx.sp)
        dist.all_to_all_single(out, grad, group=ctx.sp.group)
        return out, None


@torch.compiler.disable
def _all_to_all(x: Tensor, sp: SPGroup) -> Tensor:
    """Block n of dim 0 of ``x`` (N, ...) to rank n; returns the blocks received, block n from rank n. Never traced
    (``learner.compile``): a compiled decoder layer runs in graphs up to the exchange and after it, the exchange
    (with its gate, which reads a number on the host) eagerly between them."""
    return _AllToAll.apply(x.contiguous(), sp)


def seq_to_heads(x: Tensor, sp: SPGroup) -> Tensor:
    """(B, H, l, D) local columns, all heads -> (B, H / N, L, D) the whole sequence, this rank's heads."""
    B, H, ln, D = x.shape
    n = sp.world
    got = _all_to_all(x.reshape(B, n, H // n, ln, D).transpose(0, 1), sp)  # (N source, B, H/N, l, D)
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * ln, D)


def heads_to_seq(x: Tensor, sp: SPGroup) -> Tensor:
    """(B, L, H / N, D) the whole sequence, this rank's heads -> (B, l, H, D) local columns, all heads."""
    B, L, h, D = x.shape
    n = sp.world
    got = _all_to_all(x.reshape(B, n, L // n, h, D).transpose(0, 1), sp)  # (N source head block, B, l, h, D)
    return got.permute(1, 2, 0, 3, 4).reshape(B, L // n, n * h, D)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sp: SPGroup) -> Tensor:
        out = x.clone()
        gate(sp)
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sum_over_group(x: Tensor, sp: SPGroup) -> Tensor:
    """The sum of the ranks' ``x``; its gradient goes back unchanged to each rank's own ``x`` (every rank computes
    the same function of the sum)."""
    return _SumOverGroup.apply(x, sp) if sp.active else x


# ------------------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class _Exchange:
    sp: SPGroup
    mask: Tensor | None
    """The whole sequence's mask in the kernel's form (bool for sdpa, additive for eager); None: causal."""


class _Heads:
    """What the kernels read of the attention module, with key/value heads already repeated to the query heads."""

    def __init__(self, module: nn.Module, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = getattr(module, "is_causal", True)
        self.training = module.training


def sp_mask(sp: SPGroup, mask: Tensor | None, batch: int, device: torch.device) -> Tensor:
    """What to pass as the language model's ``attention_mask``: a 4D tensor (transformers passes 4D masks to the
    layers as given) carrying the group and the whole sequence's ``mask`` (None: causal)."""
    carrier = torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device) if mask is None else mask
    carrier = carrier.view(carrier.shape)  # a fresh tensor object: the attribute is this forward's alone
    setattr(carrier, _ATTR, _Exchange(sp, mask))
    return carrier


def _inner(kind: str, module: nn.Module):
    if kind == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def _causal(L: int, kind: str, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    if kind == "sdpa":
        return None
    allowed = torch.ones((L, L), dtype=torch.bool, device=device).tril()
    return torch.zeros((1, 1, L, L), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _ulysses_attention(kind: str):
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
        ex: _Exchange | None = getattr(attention_mask, _ATTR, None)
        inner = _inner(kind, module)
        if ex is None:  # not a sequence-parallel forward
            return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        sp, n = ex.sp, ex.sp.world
        B, H, ln, D = query.shape
        kv = key.shape[1]
        if H % n:
            raise ValueError(f"learner.sequence_parallel={n} does not divide the decoder's {H} attention heads")
        groups = H // kv
        if kv % n:  # fewer key/value heads than the group has ranks (or not a multiple): one per query head
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
            kv, groups = H, 1
        qkv = seq_to_heads(torch.cat([query.reshape(B, n, H // n, ln, D), key.reshape(B, n, kv // n, ln, D),
                                      value.reshape(B, n, kv // n, ln, D)], dim=2).flatten(1, 2), sp)
        q, k, v = qkv.split([H // n, kv // n, kv // n], dim=1)
        mask = ex.mask if ex.mask is not None else _causal(q.shape[2], kind, q.dtype, q.device)
        for k_ in ("is_causal", "position_ids"):
            kwargs.pop(k_, None)
        out, _ = inner(_Heads(module, groups), q, k, v, mask, scaling=scaling, dropout=dropout,
                       is_causal=mask is None, **kwargs)  # (B, L, H/N, D)
        return heads_to_seq(out, sp), None

    attention.__name__ = f"ulysses_{kind}_attention"
    return attention


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        for kind, name in NAMES.items():
            AttentionInterface.register(name, _ulysses_attention(kind))
            # the masks of a forward without the exchange (a single rank's), as the wrapped kernel's
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kind])
        _REGISTERED = True


def kernel_of(name: str | None) -> str | None:
    """The kernel an attention implementation's name runs (a wrapped one: the kernel it wraps)."""
    return {v: k for k, v in NAMES.items()}.get(name, name)


def text_config(hf: nn.Module) -> Any:
    cfg = hf.config
    return getattr(cfg, "text_config", None) or cfg


def install(hf: nn.Module) -> str:
    """Route the decoder's attention through the exchange (idempotent; a forward without :func:`sp_mask` is
    unchanged); returns the kernel it wraps."""
    cfg = text_config(hf)
    now = cfg._attn_implementation
    wrapped = {v: k for k, v in NAMES.items()}
    if now in wrapped:
        return wrapped[now]
    if now not in NAMES:
        raise ValueError(f"learner.sequence_parallel needs the decoder's attention to be sdpa or eager "
                         f"(model.attn_implementation), not {now!r}")
    register()
    cfg._attn_implementation = NAMES[now]
    return now


# ------------------------------------------------------------------------------------------ the forward
def _embeds(inner: nn.Module, encoded: dict[str, Any], ids: Tensor, split: SeqSplit, pad_id: int
            ) -> tuple[Tensor, dict[str, Any]]:
    """This rank's input embeddings, the vision features of its columns scattered in, and Qwen3-VL's deepstack
    inputs for its columns (``visual_pos_masks``, ``deepstack_visual_embeds``)."""

    embeds = stand_in_zero(encoded, inner.get_input_embeddings()(split.local(ids, pad_id)))
    masks: dict[str, Tensor] = {}
    deep: dict[str, list[Tensor]] = {}
    for kind, mask, feats, layers in features_by_kind(inner.config, encoded, ids, embeds):
        local_mask, idx = split.feature_index(mask)
        embeds = embeds.masked_scatter(local_mask[..., None].expand_as(embeds), feats[idx])
        masks[kind] = mask
        if layers is not None:
            deep[kind] = layers
    extra: dict[str, Any] = {}
    if deep:
        visual, layers = _deepstack_inputs(masks, deep)
        local_mask, idx = split.feature_index(visual)
        extra = {"visual_pos_masks": local_mask, "deepstack_visual_embeds": [layer[idx] for layer in layers]}
    return embeds, extra


def hidden_states(hf: nn.Module, batch: Any, sp: SPGroup, *, shared_prompt: bool) -> tuple[Tensor, SeqSplit, Any]:
    """This rank's final hidden states (sequences, l, H) of ``batch`` (rows, or the packed layout with
    ``shared_prompt``), its :class:`~streamgrpo.models.seq_split.SeqSplit` and the packed layout (None: rows)."""

    kind = install(hf)
    prepare_batch(batch, hf)
    inner = hf.model
    padded = batch.input_ids[batch.attention_mask == 0]
    pad_id = int(padded[0]) if padded.numel() else 0
    if shared_prompt:
        packed = pack_batch(batch, pad_id)
        ids, positions, seq_groups = packed.input_ids, packed.position_ids, range(len(batch.groups))
    else:
        packed, ids, positions, seq_groups = None, batch.input_ids, batch.position_ids, None
    split = SeqSplit(int(ids.shape[1]), sp.world, sp.rank)
    mask = None
    if packed is not None:
        allowed = block_mask(split.pad(packed.segment_NL, PAD_SEGMENT))
        dtype = next(hf.parameters()).dtype
        mask = allowed if kind == "sdpa" else torch.zeros(allowed.shape, dtype=dtype, device=allowed.device
                                                          ).masked_fill_(~allowed, torch.finfo(dtype).min)
    encoded = encode_once(inner, batch, seq_groups, sp)  # a frozen trunk: each rank its share of the frames
    embeds, extra = _embeds(inner, encoded, ids, split, pad_id)
    out = inner.language_model(input_ids=None, inputs_embeds=embeds, position_ids=split.local_positions(positions),
                               attention_mask=sp_mask(sp, mask, int(ids.shape[0]), ids.device), use_cache=False,
                               **extra)
    return out.last_hidden_state, split, packed
