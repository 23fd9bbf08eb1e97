"""Applying a received version to a model, and LoRA mode (pure tensor functions, no sockets).

:func:`apply_to_model` copies in place (no reallocation) after validating every name, shape and
dtype, so a model gets a whole version or none of it. In LoRA mode only adapter tensors travel
(:func:`filter_lora`); the generator merges ``W0 + alpha/r * B @ A`` into its pristine base weights
with :class:`LoraApplier` (or :func:`merge_lora_into` directly).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch


class WeightsApplyError(ValueError):
    """Received tensors do not fit the model (the message names the tensor); nothing was copied."""


def apply_to_model(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, strict: bool = False, allow_cast: bool = False
) -> int:
    """Copy received tensors in place into the model's parameters and buffers; returns how many.

    All or nothing: every name, shape and dtype is checked before the first copy, and a mismatch
    raises :class:`WeightsApplyError` naming the tensor. No storage is reallocated (``copy_`` into
    the existing tensors), so engines holding pointers to the weights keep working. ``strict``
    also requires every entry of ``model.state_dict()`` to be present; ``allow_cast`` accepts a
    floating dtype that differs (e.g. float32 sent to a bfloat16 model).
    """
    targets = model.state_dict(keep_vars=True)
    for name, src in tensors.items():
        dst = targets.get(name)
        if dst is None:
            raise WeightsApplyError(f"weights: tensor {name!r} is not a parameter or buffer of the model")
        if tuple(dst.shape) != tuple(src.shape):
            raise WeightsApplyError(f"weights: tensor {name!r} has shape {tuple(src.shape)}, the model has {tuple(dst.shape)}")
        if dst.dtype != src.dtype and not (allow_cast and dst.is_floating_point() and src.is_floating_point()):
            raise WeightsApplyError(f"weights: tensor {name!r} has dtype {src.dtype}, the model has {dst.dtype}")
    if strict:
        missing = sorted(set(targets) - set(tensors))
        if missing:
            raise WeightsApplyError(f"weights: {len(missing)} model tensors missing from the version, e.g. {missing[:3]}")
    cuda = False
    with torch.no_grad():
        for name, src in tensors.items():
            dst = targets[name]
            non_blocking = dst.is_cuda and src.is_pinned()
            cuda = cuda or non_blocking
            dst.copy_(src, non_blocking=non_blocking)
    if cuda:
        torch.cuda.synchronize()
    return len(tensors)


# -------------------------------------------------------------------------------------- LoRA
LORA_MARK = "lora_"
_LORA_RE = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def filter_lora(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (names containing ``lora_``): what travels in LoRA mode."""
    return {k: v for k, v in named_tensors.items() if LORA_MARK in k}


def lora_pairs(adapter_tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group peft adapter tensors by module path: ``{module: (A_rk, B_or)}``.

    Accepts peft names with or without the ``base_model.model.`` prefix and the adapter name
    (``...q_proj.lora_A.default.weight`` / ``...q_proj.lora_A.weight``). Anything else named
    ``lora_`` (embedding adapters, DoRA magnitudes) is an error naming the tensor.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    adapters: dict[str, str | None] = {}
    for name, t in adapter_tensors.items():
        m = _LORA_RE.match(name)
        if m is None:
            raise WeightsApplyError(f"weights: adapter tensor {name!r} is not a linear LoRA A/B weight (unsupported)")
        mod = m["mod"]
        if mod in adapters and adapters[mod] != m["adapter"]:
            raise WeightsApplyError(f"weights: module {mod!r} has two adapters ({adapters[mod]!r}, {m['adapter']!r})")
        adapters[mod] = m["adapter"]
        halves.setdefault(mod, {})[m["ab"]] = t
    out = {}
    for mod, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise WeightsApplyError(f"weights: module {mod!r} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise WeightsApplyError(f"weights: module {mod!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain")
        out[mod] = (a, b)
    return out


def lora_base_name(module: str, base_names) -> str:
    """The weight a module's adapter merges into: ``<module>.weight`` or ``<module>.base_layer.weight``."""
    for cand in (f"{module}.weight", f"{module}.base_layer.weight"):
        if cand in base_names:
            return cand
    raise WeightsApplyError(f"weights: no base weight for adapted module {module!r} ({module}.weight)")


def merge_lora_into(
    base_tensors: Mapping[str, torch.Tensor], adapter_tensors: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Merged weights ``W0 + scale * B @ A`` of every adapted module, keyed by base weight name.

    ``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). ``base_tensors`` are
    the *pristine* base weights (never a previously merged model, or updates accumulate); the
    result is new tensors in the base dtype, ready for :func:`apply_to_model`.
    """
    out = {}
    for mod, (a, b) in lora_pairs(adapter_tensors).items():
        name = lora_base_name(mod, base_tensors)
        w = base_tensors[name]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise WeightsApplyError(f"weights: adapter of {mod!r} gives {(b.shape[0], a.shape[1])}, base {name!r} is {tuple(w.shape)}")
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
        out[name] = (w.to(torch.float32) + delta.to(w.device)).to(w.dtype)
    return out


class LoraApplier:
    """Generator side of LoRA mode: keeps the pristine base weights of the adapted modules.

    ``apply(adapter_tensors)`` merges each new adapter into the saved base (never into already
    merged weights) and copies the result into the model in place. The first call clones just the
    weights it adapts, so the extra memory is the adapted matrices only.
    """

    def __init__(self, model: torch.nn.Module, scale: float):
        self.model = model
        self.scale = float(scale)
        self._base: dict[str, torch.Tensor] = {}

    def apply(self, adapter_tensors: Mapping[str, torch.Tensor]) -> int:
        state = self.model.state_dict()
        for mod in lora_pairs(adapter_tensors):
            name = lora_base_name(mod, state)
            if name not in self._base:
                self._base[name] = state[name].detach().clone()
        merged = merge_lora_into(self._base, adapter_tensors, self.scale)
        return apply_to_model(self.model, merged)
