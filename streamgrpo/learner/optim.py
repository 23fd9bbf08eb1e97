"""The learner's optimizer: AdamW with per-module learning rates and the ``learner.*`` lr schedule
(pure set-up; :class:`~streamgrpo.learner.trainer.Learner` owns the instances)."""

from __future__ import annotations

import math
from typing import Any

import torch

from streamgrpo.config import Config
from streamgrpo.learner.master_weights import MasterAdamW
from streamgrpo.models.loading import parameter_group

__all__ = ["fused_adamw", "lr_lambda", "make_optimizer", "param_groups"]


def lr_lambda(lc):
    """Linear warm-up, then constant / cosine / linear decay to 0 at max_steps."""

    def f(step: int) -> float:
        if lc.warmup_steps and step < lc.warmup_steps:
            return (step + 1) / lc.warmup_steps
        if lc.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - lc.warmup_steps) / max(1, lc.max_steps - lc.warmup_steps))
        if lc.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return f


def param_groups(named: list[tuple[str, torch.nn.Parameter]], lc) -> list[dict[str, Any]]:
    """AdamW parameter groups: ``learner.vision_lr`` / ``merger_lr`` for the vision tower / merger
    (when set), ``learning_rate`` for the rest. Names may carry a peft prefix (``base_model.model.``);
    a name outside the known Qwen-VL modules gets ``learning_rate``. Empty groups are left out."""

    if lc.vision_lr is None and lc.merger_lr is None:
        return [{"params": [p for _, p in named], "lr": lc.learning_rate, "name": "all"}]
    lrs = {"vision": lc.vision_lr or lc.learning_rate, "mlp": lc.merger_lr or lc.learning_rate,
           "llm": lc.learning_rate}
    buckets: dict[str, list[torch.nn.Parameter]] = {"llm": [], "mlp": [], "vision": []}
    for name, p in named:
        bare = name.removeprefix("base_model.model.")
        try:
            buckets[parameter_group(bare)].append(p)
        except ValueError:
            buckets["llm"].append(p)
    return [{"params": ps, "lr": lrs[g], "name": g} for g, ps in buckets.items() if ps]


def fused_adamw(device_type: str, offload: bool) -> bool | None:
    """Whether AdamW runs torch's fused kernel: on a GPU (one kernel per group of tensors instead of a dozen
    elementwise passes over 12 bytes a parameter of state), and on the host under ZeRO-Offload (DeepSpeed's
    own CPU Adam would need compiling). None elsewhere: torch's default (the for-loop on a CPU learner)."""
    return True if offload or device_type == "cuda" else None


def make_optimizer(model: torch.nn.Module, cfg: Config, *, fused: bool | None = None, master_weights: bool = False):
    """AdamW over the trainable parameters (per-module learning rates, see :func:`param_groups`) and
    the LambdaLR schedule of ``learner.*`` (it scales every group's peak rate alike).

    ``fused``: torch's fused kernel (:func:`fused_adamw` says when the learner asks for it).
    ``master_weights``: over float32 master copies of the (bf16) parameters
    (:class:`~streamgrpo.learner.master_weights.MasterAdamW`, ``learner.master_weights``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("no trainable parameters: check model.tune_mm_llm / tune_mm_mlp / tune_mm_vision")
    lc = cfg.learner
    cls = MasterAdamW if master_weights else torch.optim.AdamW
    opt = cls(param_groups(named, lc), lr=lc.learning_rate, betas=(lc.adam_beta1, lc.adam_beta2),
              eps=lc.adam_eps, weight_decay=lc.weight_decay, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lc))
    return opt, sched
