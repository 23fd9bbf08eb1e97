"""Loading the policy and its processor, choosing devices, and freezing modules by the seed-era flags.

The loading code is the real one (``from_pretrained("Qwen/Qwen2.5-VL-3B-Instruct")`` works where the
hub is reachable); tests and the CPU demo point it at a tiny local model directory instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from streamgrpo.models.attention import resolve
from streamgrpo.models.vision_attention import install as install_packed_vision_attention

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Module-name prefixes (as in named_parameters of the *ForConditionalGeneration classes of
# transformers 5) for the three groups that tune_mm_llm / tune_mm_mlp / tune_mm_vision switch.
_VISION_MERGER = ("model.visual.merger", "model.visual.deepstack_merger_list")
_VISION = ("model.visual.",)
_LLM = ("model.language_model.", "lm_head.")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but CUDA is not available on this machine")
    return torch.device(name)


def detect_arch(name_or_path: str) -> str:
    """``qwen2_5_vl`` or ``qwen3_vl`` from a local config.json (hub ids: from the name)."""
    cfg_file = Path(name_or_path) / "config.json"
    if cfg_file.is_file():
        model_type = json.loads(cfg_file.read_text()).get("model_type", "")
    else:
        model_type = name_or_path.lower().replace(".", "_").replace("-", "_")
    if "qwen3_vl" in model_type:
        return "qwen3_vl"
    if "qwen2_5_vl" in model_type or "qwen2_vl" in model_type:
        return "qwen2_5_vl"
    raise ValueError(f"{name_or_path}: model type {model_type!r} is not a supported Qwen-VL (qwen2_5_vl, qwen3_vl)")


def load_processor(name_or_path: str, revision: str | None = None):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(name_or_path, revision=revision)
    proc.tokenizer.padding_side = "left"
    return proc


def load_model(model_cfg, device: torch.device | str = "cpu", *, dtype: str | None = None, trainable: bool = False,
               custom_mask: bool = False):
    """Load the policy as the transformers class of its checkpoint, on ``device``, in ``dtype``, with the
    attention kernel :func:`~streamgrpo.models.attention.resolve` picks (``custom_mask``: learner.shared_prompt),
    the vision tower's packed into one call per block (:mod:`streamgrpo.models.vision_attention`)."""
    from transformers import AutoModelForImageTextToText


    dtype_name = dtype or model_cfg.dtype
    if torch.device(device).type == "cpu" and dtype_name == "float16":
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    attn = resolve(model_cfg.attn_implementation, torch.device(device).type, custom_mask=custom_mask)
    model = AutoModelForImageTextToText.from_pretrained(
        model_cfg.name_or_path, revision=model_cfg.revision, dtype=_DTYPES[dtype_name], attn_implementation=attn
    )
    model.to(device)
    install_packed_vision_attention(model)  # sdpa/eager: the vision tower's chunks in one call per block (same values)
    if model_cfg.fp32_lm_head:
        from streamgrpo.models.head import use_fp32_head

        use_fp32_head(model)
    if trainable:
        model.train()
        apply_freezing(model, model_cfg)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def store_frozen_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Keep the floating-point parameters that do not train in ``dtype`` (buffers such as rotary
    frequencies stay as they are); return how many bytes that frees. Under bf16 autocast a frozen
    weight is only ever read as bf16, so a float32 copy of it is memory for nothing."""
    freed = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            freed += p.numel() * (p.element_size() - torch.empty((), dtype=dtype).element_size())
            p.data = p.data.to(dtype)
    return freed


def parameter_group(name: str) -> str:
    """Which of ``llm`` / ``mlp`` (vision-language merger) / ``vision`` a parameter belongs to."""
    if name.startswith(_VISION_MERGER):
        return "mlp"
    if name.startswith(_VISION):
        return "vision"
    if name.startswith(_LLM):
        return "llm"
    raise ValueError(f"parameter {name!r} belongs to no known Qwen-VL module group")


def apply_freezing(model: torch.nn.Module, model_cfg) -> tuple[int, int]:
    """Set requires_grad from tune_mm_llm / tune_mm_mlp / tune_mm_vision; return (trainable, total)."""
    flags = {"llm": model_cfg.tune_mm_llm, "mlp": model_cfg.tune_mm_mlp, "vision": model_cfg.tune_mm_vision}
    trainable = total = 0
    for name, p in model.named_parameters():
        on = flags[parameter_group(name)]
        p.requires_grad_(on)
        total += p.numel()
        trainable += p.numel() if on else 0
    log.info("trainable parameters: %d of %d (%.1f%%)", trainable, total, 100.0 * trainable / max(total, 1))
    return trainable, total
