"""Where and in what precision a learner rank keeps each kind of tensor, read from the config (and,
for the deepspeed backend, its DeepSpeed JSON): what both the static memory plan
(:mod:`streamgrpo.learner.memory.plan`) and the step's (:mod:`streamgrpo.learner.memory.step`) read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    sequence_parallel: int = 1
    """``learner.sequence_parallel``: ranks a sequence is split over (static parts unchanged: each holds the
    weights as a rank without it does; ZeRO partitions over all the ranks)."""
    reference_bytes: float = 0.0
    """Bytes per parameter of the reference copy (0: none)."""
    master_weights: bool = False
    """``learner.master_weights`` (torch backend): trained weights in bf16, float32 masters in the optimizer."""
    update_guard: bool = False
    """``learner.max_update_kl``: a copy of the trained weights is kept through each step (torch backend)."""
    optimizer_impl: str = "fused"
    """torch AdamW's implementation: ``fused`` (on a GPU), ``foreach`` or ``for`` (a CPU learner)."""
    reduce_bucket: float = 5e8
    """DeepSpeed ``reduce_bucket_size`` (elements)."""
    allgather_bucket: float = 5e8
    """DeepSpeed ``allgather_bucket_size`` (elements)."""
    overlap_comm: bool = False
    live_params: float = 1e9
    """ZeRO-3 ``stage3_max_live_parameters``."""
    prefetch_bucket: float = 5e7
    """ZeRO-3 ``stage3_prefetch_bucket_size``."""

    @classmethod
    def from_config(cls, cfg: Any, ds_config: Mapping[str, Any] | None = None, world_size: int = 1) -> Placement:
        """From a streamgrpo Config and, for the deepspeed backend, its resolved DeepSpeed JSON."""
        lc, lora = cfg.learner, cfg.model.lora
        reference = DTYPE_BYTES[cfg.model.dtype] if cfg.loss.beta > 0 and lora is None else 0
        common = dict(backend=lc.backend, quantize_4bit=bool(lora is not None and lora.quantize_4bit),
                      world_size=world_size, reference_bytes=reference,
                      sequence_parallel=int(getattr(lc, "sequence_parallel", 1)))
        if lc.backend != "deepspeed":
            return cls(bf16=bool(lc.bf16), master_weights=bool(lc.master_weights),
                       update_guard=lc.max_update_kl is not None,
                       optimizer_impl="for" if lc.device == "cpu" else "fused", **common)
        ds = ds_config or {}
        zero = ds.get("zero_optimization", {}) or {}
        halves = bool(ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled"))
        stage = int(zero.get("stage", 0))
        return cls(bf16=halves, zero_stage=stage,
                   offload_optimizer=_offload_device(zero.get("offload_optimizer")),
                   offload_param=_offload_device(zero.get("offload_param")),
                   reduce_bucket=_number(zero.get("reduce_bucket_size"), 5e8),
                   allgather_bucket=_number(zero.get("allgather_bucket_size"), 5e8),
                   overlap_comm=bool(zero.get("overlap_comm", stage >= 3)),
                   live_params=_number(zero.get("stage3_max_live_parameters"), 1e9),
                   prefetch_bucket=_number(zero.get("stage3_prefetch_bucket_size"), 5e7), **common)


def _number(value: Any, default: float) -> float:
    """A DeepSpeed size (``"auto"`` or missing: DeepSpeed's default)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _offload_device(block: Any) -> str:
    if not isinstance(block, Mapping):
        return "none"
    return str(block.get("device", "none") or "none").lower()
