"""The ``model`` section: which checkpoint, its precision and attention, what trains, LoRA."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class LoraConfig(Section):
    r: int = Field(16, ge=1, le=1024)
    """LoRA rank."""
    alpha: int = Field(32, ge=1, le=4096)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names (suffixes) of the language model that get adapters."""
    quantize_4bit: bool = False
    """QLoRA: load the frozen base in 4-bit NF4 with bitsandbytes (CUDA only)."""


class ModelConfig(Section):
    name_or_path: str = "Qwen/Qwen2.5-VL-3B-Instruct"
    """Hub id or local directory of the policy (a Qwen2.5-VL or Qwen3-VL checkpoint)."""
    arch: Literal["auto", "qwen2_5_vl", "qwen3_vl"] = "auto"
    """Model family; `auto` reads it from the checkpoint's config.json."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for the rollout engine and (unless learner.bf16 is false) the learner."""
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """Attention kernel. `auto`: flash_attention_2 where the flash-attn package is installed and the model is on CUDA (and learner.shared_prompt is off), else sdpa; the choice is logged. flash_attention_2 asked for without flash-attn or CUDA falls back to sdpa with a one-line warning."""
    fp32_lm_head: bool = False
    """Both roles compute the last projection (hidden states to vocabulary logits) and the log-softmax in float32, whatever model.dtype and learner.bf16 say (the HF engine and the learner; vLLM computes it in its own dtype). Narrows the bf16 generator-learner gap; costs a float32 copy of the projection's weight while it runs. See docs/training.md."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) to load."""
    tune_mm_llm: bool = True
    """Train the language model (decoder layers, embeddings, lm_head)."""
    tune_mm_mlp: bool = True
    """Train the vision-language merger (projector)."""
    tune_mm_vision: bool = False
    """Train the vision encoder blocks."""
    lora: Optional[LoraConfig] = None
    """LoRA/QLoRA adapters; null trains full weights."""
