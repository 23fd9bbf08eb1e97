"""Applying received weights to a model: :func:`apply_to_model` (pure tensor code, no sockets).

It copies in place (no reallocation) after validating every name, shape and dtype, so a model gets
a whole version or none of it; from pinned host memory to a CUDA model the copies are asynchronous,
with one synchronisation at the end.
"""

from __future__ import annotations

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
    devices = set()
    with torch.no_grad():
        for name, src in tensors.items():
            dst = targets[name]
            non_blocking = dst.is_cuda and src.is_pinned()
            if non_blocking:
                devices.add(dst.device)
            dst.copy_(src, non_blocking=non_blocking)
    for device in devices:  # the source buffer may be reused once this returns
        torch.cuda.synchronize(device)
    return len(tensors)
