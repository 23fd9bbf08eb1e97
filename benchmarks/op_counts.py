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


def _is_kernel(name: str) -> bool:
    """A kernel inductor generated (``cpp_fused_*`` on a CPU, ``triton_*`` on a GPU), recorded by the profiler when
    ``torch._inductor.config.cpp.enable_kernel_profile`` is on."""
    return "cpp_fused" in name or name.startswith("triton_")


CLIP_RANGE = "clip_grad_norm_"
# aten ops that only make a tensor's metadata (views, strides, empty buffers): no kernel on a GPU
METADATA_OPS = {f"aten::{n}" for n in (
    "as_strided", "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "slice", "select", "narrow", "detach", "alias", "empty", "empty_strided",
    "empty_like", "resolve_conj", "resolve_neg", "lift_fresh", "split", "split_with_sizes", "chunk", "unbind",
    "contiguous", "flatten", "unflatten", "view_as", "result_type", "set_")}


def _in_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.") or event.name == CLIP_RANGE:  # torch.optim's ranges: step, zero_grad
            return True
        event = event.cpu_parent
    return False


@contextlib.contextmanager
def _clip_in_a_range():
    """``torch.nn.utils.clip_grad_norm_`` inside a profiler range while counting (a loop over parameters on a CPU)."""
    import torch.nn.utils as nn_utils
    from torch.profiler import record_function

    original = nn_utils.clip_grad_norm_

    def clip(*args, **kwargs):
        with record_function(CLIP_RANGE):
            return original(*args, **kwargs)
    nn_utils.clip_grad_norm_ = clip
    try:
        yield
    finally:
        nn_utils.clip_grad_norm_ = original


@contextlib.contextmanager
def profiled():
    """``with profiled() as p: step()``, then ``p["aten_ops"]``, ``p["kernels"]``: what a step issued, counted from
    torch.profiler's events (every ``aten::`` op, nested ones included, as issue 52's GPU profile counted them; and
    inductor's generated kernels), outside the optimizer's ``step``/``zero_grad`` and the gradient clipping
    (counted apart in ``optimizer_ops``: a loop over parameters on a CPU, fused/foreach kernels on a GPU).
    ``launches``: what would launch a kernel on a GPU: the innermost aten ops that are not views or empty
    buffers (:data:`METADATA_OPS`; ``aten::mm`` counts once, not its ``resolve_conj`` inside), and inductor's
    kernels. Unlike
    :class:`OpCounter` (a ``TorchDispatchMode``, under which torch.compile does not compile: dynamo runs the frame
    eagerly), this sees a compiled step as it runs: the aten ops its graphs still call (matmuls, attention: extern
    kernels) and each fused kernel it launches. Backward included. Inductor records its CPU kernels only if
    :func:`record_kernels` was called before it compiled them."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    with _clip_in_a_range(), profile(activities=[ProfilerActivity.CPU]) as prof:
        yield out
    names: Counter = Counter()
    optimizer = launches = 0
    for e in prof.events():
        if not (e.name.startswith("aten::") or _is_kernel(e.name)):
            continue
        if _in_optimizer(e):
            optimizer += 1
            continue
        names[e.name] += 1
        if _is_kernel(e.name) or (e.name not in METADATA_OPS and not any(
                c.name.startswith("aten::") and c.name not in METADATA_OPS for c in e.cpu_children)):
            launches += 1
    out["aten_ops"] = sum(n for k, n in names.items() if k.startswith("aten::"))
    out["kernels"] = sum(n for k, n in names.items() if _is_kernel(k))
    out["ops_and_kernels"] = out["aten_ops"] + out["kernels"]
    out["launches"] = launches
    out["optimizer_ops"] = optimizer
    out["by_name"] = dict(names)


def record_kernels() -> None:
    """Make inductor's generated CPU kernels profiler events (before anything compiles; part of its cache key)."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True
