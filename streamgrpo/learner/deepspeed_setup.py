"""DeepSpeed plumbing for the learner: the engine config streamgrpo derives from ``learner.*`` and an
import that never JIT-compiles."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from streamgrpo.config import Config, ConfigError
from streamgrpo.config.deepspeed_files import compile_refusal, shipped_names
from streamgrpo.config.deepspeed_files import resolve as resolve_deepspeed

DEFAULT_DEEPSPEED = {
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 200_000_000,
                          "reduce_scatter": True, "reduce_bucket_size": 200_000_000, "overlap_comm": False,
                          "contiguous_gradients": True},
}
"""Used when ``learner.backend=deepspeed`` and no ``learner.deepspeed_config`` is given (ZeRO-2)."""


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    """The DeepSpeed JSON of ``learner.deepspeed_config`` (default: ZeRO-2), with what streamgrpo owns set.

    streamgrpo builds AdamW and the lr schedule from ``learner.*`` and runs gradient accumulation
    itself, so the file may not carry ``optimizer``/``scheduler`` blocks; ``bf16.enabled`` follows
    ``learner.bf16`` and ``gradient_clipping`` follows ``learner.max_grad_norm``.
    """
    lc = cfg.learner
    if lc.deepspeed_config:
        path = resolve_deepspeed(lc.deepspeed_config)
        try:
            ds = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"learner.deepspeed_config={lc.deepspeed_config!r}: cannot read it as JSON ({exc}; "
                              f"shipped: {', '.join(shipped_names())})") from None
    else:
        ds = copy.deepcopy(DEFAULT_DEEPSPEED)
    for block in ("optimizer", "scheduler"):
        if block in ds:
            raise ConfigError(f"learner.deepspeed_config={lc.deepspeed_config!r} has a {block!r} block: streamgrpo "
                             "builds AdamW and the lr schedule from learner.* (remove the block)")
    ds.pop("train_batch_size", None)
    ds.update({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "gradient_clipping": lc.max_grad_norm, "steps_per_print": ds.get("steps_per_print", 10**9),
               "bf16": {**ds.get("bf16", {}), "enabled": bool(lc.bf16)}})
    if lc.bf16 and ds.get("fp16", {}).get("enabled"):
        raise ConfigError("learner.bf16=true and the DeepSpeed config enables fp16: pick one")
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    if int(zero.get("stage", 0)) < 2:
        zero["overlap_comm"] = False  # ZeRO-0/1 reduce at the accumulation boundary only
    if offloads_optimizer(ds):
        # our AdamW runs fused on the host partitions (optim.fused_adamw): as fast as DeepSpeedCPUAdam, and
        # nothing to JIT-compile on a box that may have no compiler
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds


def reference_config(ds: dict[str, Any]) -> dict[str, Any] | None:
    """Under ZeRO-3, the DeepSpeed config that partitions the frozen reference (``loss.beta > 0``) like the
    policy: an engine without optimizer, the policy's precision and ZeRO-3 settings (parameter offload
    included). None below stage 3, where the reference stays a whole copy on each rank."""
    zero = ds.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) < 3:
        return None
    keep = {k: v for k, v in zero.items() if k.startswith("stage3_") or k in ("offload_param", "sub_group_size")}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "bf16": dict(ds.get("bf16", {})), "fp16": dict(ds.get("fp16", {})),
            "zero_optimization": {"stage": 3, **keep}}


def refuse_compile_under_zero3(cfg: Config) -> None:
    """``learner.compile`` with a DeepSpeed config whose stage the config check could not read (a JSON path):
    one line under ZeRO-3 (:func:`streamgrpo.config.deepspeed_files.compile_refusal`), before the model loads."""
    lc = cfg.learner
    if not (lc.compile and lc.backend == "deepspeed"):
        return
    zero = deepspeed_config(cfg).get("zero_optimization") or {}
    refusal = compile_refusal(int(zero.get("stage", 0)), lc.deepspeed_config)
    if refusal:
        raise ConfigError(refusal)


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    """Whether a DeepSpeed config keeps the optimizer states on the host (ZeRO-Offload to ``cpu``)."""
    block = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return isinstance(block, dict) and str(block.get("device", "none")).lower() == "cpu"


def import_deepspeed():
    """``import deepspeed`` without surprise compilation.

    Extensions go under the virtual environment (``TORCH_EXTENSIONS_DIR``, unless set). On CPU,
    DeepSpeed's shared-memory all-reduce op is switched off: its first use JIT-compiles C++ for
    minutes, and the learner's CPU collectives are few and small (gloo does them). The optimizer
    is a torch AdamW passed in, so no optimizer op is built either.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":  # no CUDA, or CPU ranks on a GPU host (DS_ACCELERATOR=cpu)
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    return deepspeed
