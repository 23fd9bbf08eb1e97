"""What one learner step issues, counted per region of the model: aten ops, attention calls, weight casts.

:class:`OpCounter` is a ``TorchDispatchMode``: every aten op the step dispatches (forward, recompute and
backward) passes through it. Forward pre/post hooks on the vision blocks and the decoder layers say which
region an op belongs to (``vision``, ``decoder``; everything else is ``other``: embeddings, the LM head's
chunks, the loss, the optimizer). Counted per region:

* ``ops``: aten ops (a proxy for kernel launches on a GPU: each is one or a few kernels);
* ``attention``: ``scaled_dot_product_attention`` calls (any of its backends' aten ops);
* ``weight_casts``: ``_to_copy`` of a model parameter to a narrower floating dtype (autocast reading an
  fp32 weight as bf16: one full copy of the weight per forward and per recompute); ``weight_upcasts`` the
  other way (``model.fp32_lm_head`` reading a bf16 head in float32);
* ``passes``: how many times a region's first module ran forward (a vision pass = the first vision block).

Backward ops run on autograd's thread with no module hook around them: a backward op is counted in the
region whose forward saved it only through ``other``. So compare ``total`` across variants and the
per-region forward figures within one.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "_cudnn_attention")


class OpCounter(TorchDispatchMode):
    """Counts aten ops per region (see the module docstring); ``counts[region][what]``."""

    def __init__(self, param_ptrs: set[int]):
        super().__init__()
        self.param_ptrs = param_ptrs
        self.region: list[str] = ["other"]
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = self.region[-1]
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        c = self.counts[region]
        c["ops"] += 1
        if any(a in name for a in _ATTENTION) and "backward" not in name:
            c["attention"] += 1
        if name.startswith("_to_copy") and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            dtype = kwargs.get("dtype")
            if (dtype is not None and dtype != src.dtype and src.is_floating_point()
                    and src.untyped_storage().data_ptr() in self.param_ptrs):
                down = torch.finfo(dtype).bits < torch.finfo(src.dtype).bits
                c["weight_casts" if down else "weight_upcasts"] += 1
        return func(*args, **kwargs)

    def total(self, what: str) -> int:
        return sum(c[what] for c in self.counts.values())

    def summary(self) -> dict[str, Any]:
        out = {r: dict(c) for r, c in self.counts.items()}
        out["total"] = {k: self.total(k) for k in ("ops", "attention", "weight_casts", "weight_upcasts")}
        return out


def _blocks(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    from streamgrpo.models.batching import unwrap_model

    inner = unwrap_model(model).model
    return {"vision": list(inner.visual.blocks), "decoder": list(inner.language_model.layers)}


@contextlib.contextmanager
def counting(*models: torch.nn.Module):
    """``with counting(policy, reference) as c: step()``: an :class:`OpCounter` over the step's ops, the
    regions of every model given (their parameters are the weights a cast is counted for)."""
    ptrs = {p.untyped_storage().data_ptr() for m in models if m is not None for p in m.parameters()}
    counter = OpCounter(ptrs)
    handles = []
    for m in models:
        if m is None:
            continue
        for region, mods in _blocks(m).items():
            for i, mod in enumerate(mods):
                def pre(_mod, _args, region=region, first=i == 0):
                    counter.region.append(region)
                    if first:
                        counter.counts[region]["passes"] += 1

                def post(_mod, _args, _out):
                    counter.region.pop()
                handles.append(mod.register_forward_pre_hook(pre))
                handles.append(mod.register_forward_hook(post))
    try:
        with counter:
            yield counter
    finally:
        for h in handles:
            h.remove()
