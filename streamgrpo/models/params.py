"""How many parameters a policy has and how many of them train, from its config alone (the model is
built on the meta device: no memory, no weights read). The learner's memory plan is made from these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ParamCounts:
    """The policy's parameters as the learner will hold them."""

    total: int
    """Every parameter of the model (LoRA: the base, without the adapters)."""
    trainable: int
    """What the optimizer updates (LoRA: the adapters)."""
    lora: bool = False

    @property
    def frozen(self) -> int:
        """Parameters held but not trained (LoRA: the whole base)."""
        return self.total if self.lora else self.total - self.trainable


def count_params(cfg):
    """The :class:`ParamCounts` of the learner's policy, read from the model's config
    alone: the model is built on the meta device (no memory, no weights read), the LoRA adapters
    counted from the layers ``model.lora.target_modules`` names (``r * (in + out)`` each). The config.json
    comes from :func:`~streamgrpo.models.model_config.load_model_config` (one try at the Hub; a missing
    one is :class:`~streamgrpo.models.model_config.ModelConfigUnavailable`, one line)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.model_config import load_model_config

    config = load_model_config(cfg.model.name_or_path, cfg.model.revision)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return policy_counts(model, cfg.model)


def policy_counts(model: torch.nn.Module, model_cfg):
    """:func:`count_params` of a built (e.g. meta-device) model under ``model_cfg``'s LoRA / tune_mm_* settings."""
    import re

    import torch

    from streamgrpo.models.loading import parameter_group

    total = sum(p.numel() for p in model.parameters())
    lora = model_cfg.lora
    if lora is not None:
        from streamgrpo.models.lora import target_regex

        pattern = re.compile(target_regex(list(lora.target_modules)))
        adapters = sum(lora.r * (m.in_features + m.out_features) for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name))
        return ParamCounts(total, adapters, lora=True)
    flags = {"llm": model_cfg.tune_mm_llm, "mlp": model_cfg.tune_mm_mlp, "vision": model_cfg.tune_mm_vision}
    trainable = sum(p.numel() for name, p in model.named_parameters() if flags[parameter_group(name)])
    return ParamCounts(total, trainable)
