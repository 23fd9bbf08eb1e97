"""How many parameters a policy has and how many of them train, from its config alone (the model is
built on the meta device: no memory, no weights read). The learner's memory plan is made from these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamgrpo.models.loading import parameter_group
from streamgrpo.models.model_config import load_model_config

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
    largest: int = 0
    """The largest single tensor that trains (0: not known): the fused AdamW step's temporaries."""

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


    config = load_model_config(cfg.model.name_or_path, cfg.model.revision)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return policy_counts(model, cfg.model)


def policy_counts(model: torch.nn.Module, model_cfg):
    """:func:`count_params` of a built (e.g. meta-device) model under ``model_cfg``'s LoRA / tune_mm_* settings."""
    import re

    import torch


    total = sum(p.numel() for p in model.parameters())
    lora = model_cfg.lora
    if lora is not None:
        from streamgrpo.models.lora import target_regex

        pattern = re.compile(target_regex(list(lora.target_modules)))
        adapters = sum(lora.r * (m.in_features + m.out_features) for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name))
        largest = max((lora.r * max(m.in_features, m.out_features) for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name)), default=0)
        return ParamCounts(total, adapters, lora=True, largest=largest)
    flags = {"llm": model_cfg.tune_mm_llm, "mlp": model_cfg.tune_mm_mlp, "vision": model_cfg.tune_mm_vision}
    trained = [p.numel() for name, p in model.named_parameters() if flags[parameter_group(name)]]
    return ParamCounts(total, sum(trained), largest=max(trained, default=0))


@dataclass(frozen=True)
class ModelShape:
    """The layer sizes a step's activations, logits and KV cache scale with (the language model's)."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    pixels_per_video_token: int = 28 * 28 * 2
    """Pixels of one frame that make one video token: (patch x spatial merge)^2 x temporal patch
    (Qwen2.5-VL: (14 x 2)^2 x 2; Qwen3-VL: (16 x 2)^2 x 2)."""
    heads: int = 0
    """The decoder's attention heads (0: ``hidden // head_dim``)."""
    vision_hidden: int = 0
    """The vision tower's width (0: no vision tower known; the plan then has no vision part)."""
    vision_intermediate: int = 0
    vision_kept: int = 1
    """Vision blocks whose outputs a frozen trunk's replay keeps (the last; Qwen3-VL's deepstack ones too)."""
    patch_values: int = 3 * 2 * 14 * 14
    """Values of one vision patch (channels x temporal patch x patch^2; Qwen2.5-VL 1176, Qwen3-VL 1536)."""
    patches_per_token: int = 4
    """Vision patches merged into one decoder token (spatial merge^2)."""


def shape_of(config) -> ModelShape:
    """The :class:`ModelShape` of a transformers VL config (``text_config`` and ``vision_config``)."""
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    pixels = 28 * 28 * 2
    extra: dict = {}
    if vision is not None:
        patch, merge = getattr(vision, "patch_size", 14), getattr(vision, "spatial_merge_size", 2)
        temporal = getattr(vision, "temporal_patch_size", 2)
        side = patch * merge
        pixels = side * side * temporal
        extra = dict(vision_hidden=int(getattr(vision, "hidden_size", 0) or 0),
                     vision_intermediate=int(getattr(vision, "intermediate_size", 0) or 0),
                     vision_kept=1 + len(getattr(vision, "deepstack_visual_indexes", None) or ()),
                     patch_values=getattr(vision, "in_channels", 3) * temporal * patch * patch,
                     patches_per_token=merge * merge)
    return ModelShape(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=text.intermediate_size,
                      vocab=text.vocab_size, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                      head_dim=head_dim, pixels_per_video_token=pixels, heads=heads, **extra)


def model_shape(cfg) -> ModelShape:
    """The :class:`ModelShape` of the policy's config.json (read as :func:`count_params` reads it)."""

    return shape_of(load_model_config(cfg.model.name_or_path, cfg.model.revision))
