"""What a learner rank must hold, and the check that refuses a plan that cannot fit.

The learner's static memory is arithmetic over parameter counts: the policy's weights, their
gradients, AdamW's two moments (and DeepSpeed's float32 master copy), and the reference copy for
``loss.beta > 0``. :func:`plan_memory` is that arithmetic (pure), per rank, split into what sits
on the training device and what ZeRO offload moves to the host. Alone it is a **lower bound** (on
the H100 the 3B learner peaked 8-23% above it); with the model's layer sizes and the step's token
budget it adds what a step adds (:mod:`streamgrpo.learner.memory.step`: the optimizer step's
temporaries, the micro-batch's activations, the chunked logits, the reference's forward), each a
named part, calibrated within 10% of measured peaks. CUDA workspace and allocator fragmentation
still come on top. A plan over the device's memory cannot fit, and :func:`check_fits` refuses it in
one line before the model is loaded (loading a 7B model to see it run out of memory takes minutes).

Bytes per parameter, per rank (``W`` ranks; "trains": what the optimizer updates):

* torch backend: trained weights 4 (float32), gradients 4, AdamW moments 8 (and 4 more for the copy
  ``learner.max_update_kl`` keeps through a step); with ``learner.master_weights`` trained weights 2
  (bf16) and the optimizer 12 (the float32 masters and the moments; their float32 gradients are the 4);
  weights that do not train 4, or 2 with ``learner.bf16`` (stored in bf16), or 0.5 under QLoRA's 4-bit base;
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

from streamgrpo.learner.distributed import local_world_size
from streamgrpo.learner.memory.placement import Placement
from streamgrpo.learner.memory.step import Workload, step_memory, workload
from streamgrpo.models.params import ModelShape, ParamCounts, count_params, model_shape

GiB = 1024 ** 3


class MemoryPlanError(ValueError):
    """The learner's static memory cannot fit where it would run (a user's setting to change)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank by part: on the training device, and on the host (ZeRO offload to CPU); the
    static parts (``device``, ``host``) and what a step adds (``step``, ``step_host``: see
    :mod:`streamgrpo.learner.memory.step`; empty when the plan is static only)."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    step_host: dict[str, float] = field(default_factory=dict)

    @property
    def static_bytes(self) -> float:
        """The device's static lower bound (weights, gradients, optimizer states, reference)."""
        return sum(self.device.values())

    @property
    def device_bytes(self) -> float:
        """The full plan on the device: static parts and the step's."""
        return self.static_bytes + sum(self.step.values())

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values()) + sum(self.step_host.values())

    def describe(self, where: str = "device") -> str:
        """``weights 7.0 + gradients 11.6 + ... GiB`` of one side (parts that are 0 left out), then
        ``+ step: optimizer temporaries 11.6 + activations 3.2 GiB`` when the plan has step parts."""
        parts, step = (self.device, self.step) if where == "device" else (self.host, self.step_host)
        text = _parts(parts)
        more = _parts(step)
        if more == "nothing":
            return text
        return more if text == "nothing" else f"{text}; + step: {more}"


def _parts(parts: Mapping[str, float]) -> str:
    shown = [f"{name} {b / GiB:.1f}" for name, b in parts.items() if b > 0]
    return " + ".join(shown) + " GiB" if shown else "nothing"


def plan_memory(counts: ParamCounts, place: Placement, shape: ModelShape | None = None,
                work: Workload | None = None) -> MemoryPlan:
    """The bytes of one learner rank: the static parts (see the module docstring for the rules), and
    with the model's ``shape`` and the step's ``work`` what a step adds
    (:func:`~streamgrpo.learner.memory.step.step_memory`)."""
    static = _static_plan(counts, place)
    if shape is None or work is None:
        return static
    step, step_host = step_memory(counts, shape, place, work)
    return MemoryPlan(static.device, static.host, step, step_host)


def _static_plan(counts: ParamCounts, place: Placement) -> MemoryPlan:
    """The static bytes of one learner rank (see the module docstring for the rules)."""
    device: dict[str, float] = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "reference": 0.0}
    host: dict[str, float] = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "reference": 0.0}
    n_train = counts.trainable
    n_all = counts.total + (counts.trainable if counts.lora else 0)  # adapters are parameters too
    device["reference"] = place.reference_bytes * counts.total
    if place.backend != "deepspeed":
        frozen_b = 0.5 if place.quantize_4bit else 2 if place.bf16 else 4
        trained_b, optimizer_b = (2, 12) if place.master_weights else (4, 8)  # master_weights: masters in AdamW
        device["weights"] = trained_b * n_train + frozen_b * counts.frozen
        device["gradients"] = 4 * n_train
        device["optimizer"] = optimizer_b * n_train
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
    """Raise :class:`MemoryPlanError` (one line, with what to change) when the plan (static parts and,
    when it has them, the step's) does not fit."""
    what = (f"{counts.total / 1e9:.2f}B parameters, "
            f"{counts.trainable / 1e9:.3g}B {'in LoRA adapters' if counts.lora else 'training'}")
    ranks = cap.ranks_per_host
    if cap.device_is_host:  # a CPU learner: device and host are the same memory, shared by this host's ranks
        need = (plan.device_bytes + plan.host_bytes) * ranks
        if 0 < cap.host_bytes < need:
            raise MemoryPlanError(
                f"not enough memory for the learner: this host has {cap.host_bytes / GiB:.1f} GiB, and {ranks} "
                f"learner rank(s) need at least {need / GiB:.1f} GiB ({plan.describe()} "
                f"each; {what}): train LoRA adapters (model.lora), lower learner.micro_batch_tokens, or use GPUs")
        return
    if plan.device_bytes > cap.device_bytes:
        raise MemoryPlanError(
            f"not enough memory for the learner: {cap.device_name} has {cap.device_bytes / GiB:.1f} GiB, and this "
            f"config needs at least {plan.device_bytes / GiB:.1f} GiB on it "
            f"({plan.describe()}; {what}): train LoRA adapters (model.lora), "
            + ("lower learner.micro_batch_tokens or turn on learner.gradient_checkpointing, "
               if plan.step.get("activations", 0) > 0.1 * plan.device_bytes else "")
            + "use more ranks with ZeRO-3 "
            "(learner.deepspeed_config: zero3), or offload the optimizer to the host (learner.deepspeed_config: zero2_offload)")
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
    sp = f", sequence parallel over {place.sequence_parallel}" if place.sequence_parallel > 1 else ""
    lines = [f"{counts.total / 1e9:.2f}B parameters, {counts.trainable / 1e9:.3g}B {trained}; {setup}, {precision}, "
             f"{place.world_size} rank(s){sp}",
             "per rank, static (weights, gradients, optimizer states, reference), then what a step adds:"
             if plan.step else "per rank, before activations (a lower bound):",
             f"  on the GPU:  {_parts(plan.device)} = {plan.static_bytes / GiB:.1f} GiB",
             f"  on the host: {_parts(plan.host)}" + (f" = {sum(plan.host.values()) / GiB:.1f} GiB" if plan.host else "")]
    if plan.step:
        step = plan.device_bytes - plan.static_bytes
        host = f"; on the host {_parts(plan.step_host)}" if sum(plan.step_host.values()) else ""
        lines.append(f"  + step:      {_parts(plan.step)} = {step / GiB:.1f} GiB{host}")
        lines.append(f"  plan:        {plan.device_bytes / GiB:.1f} GiB on the GPU")
    fits = plan.device_bytes <= gpu_bytes
    left = (f"{(gpu_bytes - plan.device_bytes) / GiB:.1f} GiB left" + ("" if plan.step else " for activations")
            if fits else "train LoRA adapters (model.lora), use more ranks with ZeRO-3, or offload the optimizer"
            + (", or lower learner.micro_batch_tokens" if plan.step else ""))
    lines.append(f"on a GPU of {gpu_bytes / GiB:.0f} GiB: {'fits' if fits else 'does not fit'} ({left})")
    return lines, fits


def host_memory_bytes() -> float:
    """Physical memory of this host (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def plan_for(cfg: Any, world_size: int = 1) -> tuple[ParamCounts, Placement, MemoryPlan]:
    """The counts (the model built on the meta device), placement and full plan (static parts and the
    step's, :mod:`streamgrpo.learner.memory.step`) of a config's learner rank."""

    counts = count_params(cfg)
    shape = model_shape(cfg)
    ds = None
    if cfg.learner.backend == "deepspeed":
        from streamgrpo.learner.deepspeed_setup import deepspeed_config

        ds = deepspeed_config(cfg)
    place = Placement.from_config(cfg, ds, world_size)
    return counts, place, plan_memory(counts, place, shape, workload(cfg, shape, world_size))


def preflight(cfg: Any, device: Any, world_size: int = 1) -> MemoryPlan:
    """The learner rank's plan, logged and checked against ``device`` before the model is loaded (the
    one impure helper: it reads the model's config and asks torch and the OS what memory there is)."""
    import logging

    import torch


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
        "memory plan per rank (static parts, then the step's): %s on %s%s", plan.describe(), device,
        f", {plan.describe('host')} on the host" if plan.host_bytes else "")
    return plan
