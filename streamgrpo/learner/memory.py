"""What a learner rank must hold before its first activation, and the check that refuses a plan
that cannot fit.

The learner's static memory is arithmetic over parameter counts: the policy's weights, their
gradients, AdamW's two moments (and DeepSpeed's float32 master copy), and the reference copy for
``loss.beta > 0``. :func:`plan_memory` is that arithmetic (pure), per rank, split into what sits
on the training device and what ZeRO offload moves to the host. It is a **lower bound**:
activations, the logits of a micro-batch, CUDA workspace, allocator fragmentation, DeepSpeed's
communication buckets and ZeRO-3's gathered layers all come on top (on the H100 the 3B learner
peaked 8-23% above it). So a plan over the device's memory cannot fit, and :func:`check_fits`
refuses it in one line before the model is loaded (loading a 7B model to see it run out of
memory takes minutes); a plan under it may still run out.

Bytes per parameter, per rank (``W`` ranks; "trains": what the optimizer updates):

* torch backend: trained weights 4 (float32), gradients 4, AdamW moments 8 (and 4 more for the copy
  ``learner.max_update_kl`` keeps through a step); weights that do not train 4, or 2 with
  ``learner.bf16`` (stored in bf16), or 0.5 under QLoRA's 4-bit base;
* deepspeed backend: every weight in the engine's dtype (2 with bf16, else 4; ZeRO-3 divides
  them by ``W``, ``offload_param`` moves them to the host); with bf16 a float32 master copy of
  what trains (4) and the moments (8), divided by ``W`` under ZeRO-1/2/3 (and bf16's own
  optimizer), on the host with ``offload_optimizer``; gradients: ZeRO-0/1 keep them whole in the
  weights' dtype, ZeRO-2/3 a float32 partition (4 / ``W``, on the host when offloaded);
* the reference (``beta > 0``, full-weight training): every weight in ``model.dtype``, whole on each
  rank, or under ZeRO-3 partitioned like the policy (``/ W``; on the host with ``offload_param``); a
  LoRA learner's reference is its base with the adapters off (no copy).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamgrpo.models.params import ParamCounts

GiB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(ValueError):
    """The learner's static memory cannot fit where it would run (a user's setting to change)."""


@dataclass(frozen=True)
class Placement:
    """Where and in what precision the learner keeps each kind of tensor (from the config)."""

    backend: str = "torch"
    bf16: bool = False
    quantize_4bit: bool = False
    zero_stage: int = 0
    offload_optimizer: str = "none"
    """``cpu``, ``nvme`` or ``none`` (DeepSpeed ``zero_optimization.offload_optimizer.device``)."""
    offload_param: str = "none"
    world_size: int = 1
    reference_bytes: float = 0.0
    """Bytes per parameter of the reference copy (0: none)."""
    update_guard: bool = False
    """``learner.max_update_kl``: a copy of the trained weights is kept through each step (torch backend)."""

    @classmethod
    def from_config(cls, cfg: Any, ds_config: Mapping[str, Any] | None = None, world_size: int = 1) -> Placement:
        """From a streamgrpo Config and, for the deepspeed backend, its resolved DeepSpeed JSON."""
        lc, lora = cfg.learner, cfg.model.lora
        reference = DTYPE_BYTES[cfg.model.dtype] if cfg.loss.beta > 0 and lora is None else 0
        common = dict(backend=lc.backend, quantize_4bit=bool(lora is not None and lora.quantize_4bit),
                      world_size=world_size, reference_bytes=reference)
        if lc.backend != "deepspeed":
            return cls(bf16=bool(lc.bf16), update_guard=lc.max_update_kl is not None, **common)
        ds = ds_config or {}
        zero = ds.get("zero_optimization", {}) or {}
        halves = bool(ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled"))
        return cls(bf16=halves, zero_stage=int(zero.get("stage", 0)),
                   offload_optimizer=_offload_device(zero.get("offload_optimizer")),
                   offload_param=_offload_device(zero.get("offload_param")), **common)


def _offload_device(block: Any) -> str:
    if not isinstance(block, Mapping):
        return "none"
    return str(block.get("device", "none") or "none").lower()


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank by part: on the training device, and on the host (ZeRO offload to CPU)."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    @property
    def device_bytes(self) -> float:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values())

    def describe(self, where: str = "device") -> str:
        """``weights 7.0 + gradients 11.6 + ... GiB`` of one side (parts that are 0 left out)."""
        parts = self.device if where == "device" else self.host
        shown = [f"{name} {b / GiB:.1f}" for name, b in parts.items() if b > 0]
        return " + ".join(shown) + " GiB" if shown else "nothing"


def plan_memory(counts: ParamCounts, place: Placement) -> MemoryPlan:
    """The static bytes of one learner rank (see the module docstring for the rules)."""
    device: dict[str, float] = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "reference": 0.0}
    host: dict[str, float] = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "reference": 0.0}
    n_train = counts.trainable
    n_all = counts.total + (counts.trainable if counts.lora else 0)  # adapters are parameters too
    device["reference"] = place.reference_bytes * counts.total
    if place.backend != "deepspeed":
        frozen_b = 0.5 if place.quantize_4bit else 2 if place.bf16 else 4
        device["weights"] = 4 * n_train + frozen_b * counts.frozen
        device["gradients"] = 4 * n_train
        device["optimizer"] = 8 * n_train
        if place.update_guard:
            device["step copy"] = 4 * n_train
        return MemoryPlan(device, host)
    w = max(1, place.world_size)
    weight_b = 2 if place.bf16 else 4
    shard = w if place.zero_stage >= 1 or place.bf16 else 1  # states partitioned over the ranks
    weights = weight_b * n_all / (w if place.zero_stage >= 3 else 1)
    if place.zero_stage >= 3:  # the reference is partitioned like the policy (deepspeed_setup.reference_config)
        device["reference"] = 0.0
        ref_b = min(place.reference_bytes, weight_b)  # the engine holds it in its own precision
        _put(device, host, "reference", ref_b * counts.total / w, place.offload_param)
    optimizer = (12 if place.bf16 else 8) * n_train / shard  # (master copy +) two moments
    if place.zero_stage >= 2:
        grads, grads_offloaded = 4 * n_train / w, place.offload_optimizer == "cpu"
    else:
        grads, grads_offloaded = weight_b * n_train, False
    _put(device, host, "weights", weights, place.offload_param)
    _put(device, host, "optimizer", optimizer, place.offload_optimizer)
    _put(device, host, "gradients", grads, "cpu" if grads_offloaded else "none")
    return MemoryPlan(device, host)


def _put(device: dict[str, float], host: dict[str, float], part: str, nbytes: float, offload: str) -> None:
    """On the device, on the host (``cpu`` offload), or neither (``nvme``: on disk)."""
    if offload == "cpu":
        host[part] += nbytes
    elif offload != "nvme":
        device[part] += nbytes


@dataclass(frozen=True)
class Capacity:
    """The memory a rank can use: its device's, and its share of the host's."""

    device_name: str
    device_bytes: float
    """The training device's total memory (a CPU learner: the host's)."""
    host_bytes: float
    ranks_per_host: int = 1
    device_is_host: bool = False


def check_fits(plan: MemoryPlan, cap: Capacity, counts: ParamCounts) -> None:
    """Raise :class:`MemoryPlanError` (one line, with what to change) when the lower bound does not fit."""
    what = (f"{counts.total / 1e9:.2f}B parameters, "
            f"{counts.trainable / 1e9:.3g}B {'in LoRA adapters' if counts.lora else 'training'}")
    ranks = cap.ranks_per_host
    if cap.device_is_host:  # a CPU learner: device and host are the same memory, shared by this host's ranks
        need = (plan.device_bytes + plan.host_bytes) * ranks
        if 0 < cap.host_bytes < need:
            raise MemoryPlanError(
                f"not enough memory for the learner: this host has {cap.host_bytes / GiB:.1f} GiB, and {ranks} "
                f"learner rank(s) need at least {need / GiB:.1f} GiB before any activation ({plan.describe()} "
                f"each; {what}): train LoRA adapters (model.lora), or use GPUs")
        return
    if plan.device_bytes > cap.device_bytes:
        raise MemoryPlanError(
            f"not enough memory for the learner: {cap.device_name} has {cap.device_bytes / GiB:.1f} GiB, and this "
            f"config needs at least {plan.device_bytes / GiB:.1f} GiB on it before any activation "
            f"({plan.describe()}; {what}): train LoRA adapters (model.lora), use more ranks with ZeRO-3 "
            "(deploy/deepspeed/zero3.json), or offload the optimizer to the host (deploy/deepspeed/zero2_offload.json)")
    host_need = plan.host_bytes * ranks
    if 0 < cap.host_bytes < host_need:
        raise MemoryPlanError(
            f"not enough host memory for the learner: ZeRO offload puts at least {host_need / GiB:.1f} GiB on it "
            f"({plan.describe('host')} for each of {ranks} rank(s); {what}), and it has "
            f"{cap.host_bytes / GiB:.1f} GiB: offload less, or use more hosts")


def report(counts: ParamCounts, place: Placement, plan: MemoryPlan, gpu_bytes: float) -> tuple[list[str], bool]:
    """``streamgrpo config memory``'s lines, and whether the plan fits a GPU of ``gpu_bytes`` (pure)."""
    setup = (f"{place.backend} backend" if place.backend != "deepspeed" else
             f"deepspeed ZeRO-{place.zero_stage}" + (f", optimizer offload {place.offload_optimizer}"
                                                       if place.offload_optimizer != "none" else ""))
    precision = "bf16" if place.bf16 else "fp32"
    trained = "in LoRA adapters" if counts.lora else "training"
    lines = [f"{counts.total / 1e9:.2f}B parameters, {counts.trainable / 1e9:.3g}B {trained}; {setup}, {precision}, "
             f"{place.world_size} rank(s)",
             "per rank, before activations (a lower bound):",
             f"  on the GPU:  {plan.describe()} = {plan.device_bytes / GiB:.1f} GiB",
             f"  on the host: {plan.describe('host')}" + (f" = {plan.host_bytes / GiB:.1f} GiB" if plan.host_bytes else "")]
    fits = plan.device_bytes <= gpu_bytes
    left = f"{(gpu_bytes - plan.device_bytes) / GiB:.1f} GiB left for activations" if fits else \
        "train LoRA adapters (model.lora), use more ranks with ZeRO-3, or offload the optimizer"
    lines.append(f"on a GPU of {gpu_bytes / GiB:.0f} GiB: {'fits' if fits else 'does not fit'} ({left})")
    return lines, fits


def host_memory_bytes() -> float:
    """Physical memory of this host (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def plan_for(cfg: Any, world_size: int = 1) -> tuple[ParamCounts, Placement, MemoryPlan]:
    """The counts (the model built on the meta device), placement and plan of a config's learner rank."""
    from streamgrpo.models.params import count_params

    counts = count_params(cfg)
    ds = None
    if cfg.learner.backend == "deepspeed":
        from streamgrpo.learner.deepspeed_setup import deepspeed_config

        ds = deepspeed_config(cfg)
    place = Placement.from_config(cfg, ds, world_size)
    return counts, place, plan_memory(counts, place)


def preflight(cfg: Any, device: Any, world_size: int = 1) -> MemoryPlan:
    """The learner rank's plan, logged and checked against ``device`` before the model is loaded (the
    one impure helper: it reads the model's config and asks torch and the OS what memory there is)."""
    import logging

    import torch

    from streamgrpo.learner.distributed import local_world_size

    counts, _, plan = plan_for(cfg, world_size)
    device = torch.device(device)
    ranks = local_world_size(os.environ) if world_size > 1 else 1
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cap = Capacity(f"{device} ({props.name})", float(props.total_memory), host_memory_bytes(), ranks)
    else:
        cap = Capacity(str(device), host_memory_bytes(), host_memory_bytes(), ranks, device_is_host=True)
    check_fits(plan, cap, counts)
    logging.getLogger("streamgrpo.learner").info(
        "memory before activations, per rank (a lower bound): %s on %s%s", plan.describe(), device,
        f", {plan.describe('host')} on the host" if plan.host_bytes else "")
    return plan
