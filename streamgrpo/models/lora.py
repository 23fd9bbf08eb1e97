"""LoRA / QLoRA for the policy (peft), the generator side of LoRA mode, and ``streamgrpo model merge``.

* :func:`apply_lora` wraps the policy in a peft ``PeftModel`` with adapters on the language
  model's linear layers named by ``model.lora.target_modules`` (vision tower and merger stay
  frozen: ``model.tune_mm_*`` apply to full-weight training only). The reference policy for
  ``beta > 0`` is the same model inside ``with peft_model.disable_adapter():`` (no second copy).
* QLoRA (``model.lora.quantize_4bit``): the frozen base in 4-bit NF4 via bitsandbytes, CUDA only;
  :func:`check_quantization` says so clearly anywhere else.
* In LoRA mode only adapter tensors travel to generators (``filter_lora``), and
  :func:`make_weight_applier` merges them on the generator: ``W = W0 + alpha/r * B @ A`` into
  the pristine base weights (``LoraApplier``), so updates never accumulate.
* :func:`merge_adapter` writes a plain transformers model directory (weights, processor, README
  model card) from an adapter directory (a LoRA checkpoint) and its base model.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from streamgrpo.models.apply import WeightsApplyError, apply_to_model
from streamgrpo.models.attention import resolve
from streamgrpo.models.files import runtime_name
from streamgrpo.models.vision_attention import install as install_packed_vision_attention

log = logging.getLogger(__name__)

LANGUAGE_MODEL_PREFIX = "model.language_model."


def lora_scale(lora_cfg) -> float:
    """The adapter scale peft uses: ``alpha / r``."""
    return float(lora_cfg.alpha) / float(lora_cfg.r)


def target_regex(target_modules: list[str]) -> str:
    """peft ``target_modules`` regex: the named linear layers of the language model only
    (the Qwen vision blocks reuse names such as ``gate_proj``, and they stay frozen)."""
    if not target_modules:
        raise ValueError("model.lora.target_modules is empty: name at least one linear layer (e.g. q_proj)")
    names = "|".join(re.escape(t) for t in target_modules)
    return rf"{re.escape(LANGUAGE_MODEL_PREFIX)}(?:.*\.)?(?:{names})"


def check_quantization(lora_cfg, device: torch.device | str) -> None:
    """QLoRA needs CUDA and bitsandbytes; raise a clear error otherwise (no-op without quantize_4bit)."""
    if not lora_cfg.quantize_4bit:
        return
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f"model.lora.quantize_4bit=true (QLoRA) needs a CUDA GPU (bitsandbytes 4-bit kernels), but the learner "
            f"runs on {torch.device(device).type!r}; set model.lora.quantize_4bit=false to train plain LoRA"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise RuntimeError("model.lora.quantize_4bit=true needs the bitsandbytes package: pip install bitsandbytes") from None


def load_quantized(model_cfg, lora_cfg, device: torch.device, *, custom_mask: bool = False):
    """The frozen base in 4-bit NF4 (compute in bfloat16), prepared for k-bit training."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig


    check_quantization(lora_cfg, device)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16,
                               llm_int8_skip_modules=["visual", "lm_head"])
    model = AutoModelForImageTextToText.from_pretrained(
        model_cfg.name_or_path, revision=model_cfg.revision, quantization_config=quant,
        dtype=torch.bfloat16, device_map={"": torch.device(device).index or 0},
        attn_implementation=resolve(model_cfg.attn_implementation, torch.device(device).type,
                                    custom_mask=custom_mask),
    )
    install_packed_vision_attention(model)
    if model_cfg.fp32_lm_head:
        from streamgrpo.models.head import use_fp32_head

        use_fp32_head(model)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def apply_lora(model: torch.nn.Module, lora_cfg, seed: int = 0):
    """Wrap ``model`` in a peft model with fresh adapters (B = 0, so it starts as the base). The random A
    matrices come from ``seed`` (the run's ``seed``) on a forked RNG: the same seed gives the same adapters
    whatever ran before, and the caller's random state is left as it was."""
    from peft import LoraConfig, get_peft_model

    peft_cfg = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                          target_modules=target_regex(list(lora_cfg.target_modules)), bias="none")
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_cfg)
    n = sum(1 for name, _ in peft_model.named_parameters() if "lora_A" in name)
    if n == 0:
        raise ValueError(f"model.lora.target_modules={lora_cfg.target_modules} matched no linear layer of the "
                         "language model")
    return peft_model


# --------------------------------------------------------------------------------- generator side
# ------------------------------------------------------------------- LoRA merge maths (generators)
LORA_MARK = "lora_"
_LORA_RE = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def filter_lora(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (names containing ``lora_``): what travels in LoRA mode."""
    return {k: v for k, v in named_tensors.items() if LORA_MARK in k}


def lora_pairs(adapter_tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group peft adapter tensors by module path: ``{module: (A_rk, B_or)}``.

    Accepts peft names with or without the ``base_model.model.`` prefix and the adapter name
    (``...q_proj.lora_A.default.weight`` / ``...q_proj.lora_A.weight``). Anything else named
    ``lora_`` (embedding adapters, DoRA magnitudes) is an error naming the tensor.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    adapters: dict[str, str | None] = {}
    for name, t in adapter_tensors.items():
        m = _LORA_RE.match(name)
        if m is None:
            raise WeightsApplyError(f"weights: adapter tensor {name!r} is not a linear LoRA A/B weight (unsupported)")
        mod = m["mod"]
        if mod in adapters and adapters[mod] != m["adapter"]:
            raise WeightsApplyError(f"weights: module {mod!r} has two adapters ({adapters[mod]!r}, {m['adapter']!r})")
        adapters[mod] = m["adapter"]
        halves.setdefault(mod, {})[m["ab"]] = t
    out = {}
    for mod, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise WeightsApplyError(f"weights: module {mod!r} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise WeightsApplyError(f"weights: module {mod!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain")
        out[mod] = (a, b)
    return out


def lora_base_name(module: str, base_names) -> str:
    """The weight a module's adapter merges into: ``<module>.weight`` or ``<module>.base_layer.weight``."""
    for cand in (f"{module}.weight", f"{module}.base_layer.weight"):
        if cand in base_names:
            return cand
    raise WeightsApplyError(f"weights: no base weight for adapted module {module!r} ({module}.weight)")


def merge_lora_into(
    base_tensors: Mapping[str, torch.Tensor], adapter_tensors: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Merged weights ``W0 + scale * B @ A`` of every adapted module, keyed by base weight name.

    ``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). ``base_tensors`` are
    the *pristine* base weights (never a previously merged model, or updates accumulate); the
    result is new tensors in the base dtype, ready for :func:`apply_to_model`.
    """
    out = {}
    for mod, (a, b) in lora_pairs(adapter_tensors).items():
        name = lora_base_name(mod, base_tensors)
        w = base_tensors[name]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise WeightsApplyError(f"weights: adapter of {mod!r} gives {(b.shape[0], a.shape[1])}, base {name!r} is {tuple(w.shape)}")
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
        out[name] = (w.to(torch.float32) + delta.to(w.device)).to(w.dtype)
    return out


class LoraApplier:
    """Generator side of LoRA mode: keeps the pristine base weights of the adapted modules.

    ``apply(adapter_tensors)`` merges each new adapter into the saved base (never into already
    merged weights) and copies the result into the model in place. The first call clones just the
    weights it adapts, so the extra memory is the adapted matrices only.
    """

    def __init__(self, model: torch.nn.Module, scale: float):
        self.model = model
        self.scale = float(scale)
        self._base: dict[str, torch.Tensor] = {}

    def apply(self, adapter_tensors: Mapping[str, torch.Tensor]) -> int:
        state = self.model.state_dict()
        for mod in lora_pairs(adapter_tensors):
            name = lora_base_name(mod, state)
            if name not in self._base:
                self._base[name] = state[name].detach().clone()
        merged = merge_lora_into(self._base, adapter_tensors, self.scale)
        return apply_to_model(self.model, merged)


def make_weight_applier(cfg, engine) -> Callable[[int, dict[str, torch.Tensor]], None]:
    """``apply(version, tensors)`` for a generator: ``engine.load_weights`` for full weights; in
    LoRA mode the received adapters are merged into the pristine base weights first."""
    if cfg.model.lora is None:
        return engine.load_weights
    scale = lora_scale(cfg.model.lora)
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):  # the HF engine: merge in place
        applier = LoraApplier(model, scale)

        def apply_in_place(version: int, tensors: dict[str, torch.Tensor]) -> None:
            applier.apply(tensors)
            engine.version = int(version)

        return apply_in_place

    # other engines (vLLM): pristine base weights read from the checkpoint files, keyed by model names

    base: dict[str, torch.Tensor] = {}
    on_disk: dict[str, str] = {}  # model name -> checkpoint key

    def apply_merged(version: int, tensors: dict[str, torch.Tensor]) -> None:
        if not on_disk:
            on_disk.update({runtime_name(k): k for k in _base_names(cfg.model.name_or_path)})
        needed = {lora_base_name(mod, on_disk) for mod in lora_pairs(tensors)} - set(base)
        if needed:
            found = _read_tensors(cfg.model.name_or_path, {on_disk[n] for n in needed})
            base.update({runtime_name(k): t for k, t in found.items()})
        engine.load_weights(version, merge_lora_into(base, tensors, scale))

    return apply_merged


def _model_files(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"]))


def _base_names(name_or_path: str) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(_model_files(name_or_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    return names


def _read_tensors(name_or_path: str, names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(_model_files(name_or_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in names & set(fh.keys()):
                out[k] = fh.get_tensor(k)
    return out


# ----------------------------------------------------------------------------------------- merge
def merge_adapter(adapter: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Merge a LoRA adapter directory into its base model and write a plain transformers directory.

    ``base`` defaults to the adapter's ``base_model_name_or_path``. The output holds the merged
    weights (safetensors), the processor (from the adapter directory when it has one, else from
    the base) and a README model card. Returns ``out``.
    """
    from transformers import AutoProcessor

    adapter, out = Path(adapter), Path(out)
    cfg_file = adapter / "adapter_config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{adapter}: no adapter_config.json (is it a LoRA checkpoint directory?)")
    acfg = json.loads(cfg_file.read_text())
    base = base or acfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{cfg_file}: no base_model_name_or_path; pass --base")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    merged = load_merged(adapter, base)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    has_processor = any((adapter / f).is_file() for f in ("processor_config.json", "preprocessor_config.json"))
    AutoProcessor.from_pretrained(str(adapter) if has_processor else base).save_pretrained(out)
    (out / "README.md").write_text(merged_model_card(adapter, base, acfg))
    for extra in ("trainer_state.json",):  # provenance of the adapter's training run
        if (adapter / extra).is_file():
            shutil.copy(adapter / extra, out / f"adapter_{extra}")
    log.info("merged %s into %s -> %s", adapter, base, out)
    return out


def load_merged(adapter: str | Path, base: str):
    """The ``base`` model (in its own dtype) with the LoRA ``adapter`` directory merged in: a plain transformers
    model, no peft layers left."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base, dtype="auto")
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()


def merged_model_card(adapter: Path, base: str, adapter_cfg: dict[str, Any]) -> str:
    """The adapter's own model card (a streamgrpo checkpoint has one) plus a merge section."""
    card = adapter / "README.md"
    text = card.read_text() if card.is_file() and "streamgrpo" in card.read_text() else (
        f"---\nbase_model: {base}\nlibrary_name: transformers\npipeline_tag: image-text-to-text\n"
        f"tags: [streamgrpo, grpo, lora]\n---\n\n# LoRA-merged model\n")
    r, alpha = adapter_cfg.get("r"), adapter_cfg.get("lora_alpha")
    return text.rstrip() + (
        f"\n\n## LoRA merge\n\nMerged with `streamgrpo model merge`: base `{base}` + adapter `{adapter}` "
        f"(r = {r}, alpha = {alpha}, scale = alpha / r). This directory loads with plain transformers "
        "(`AutoModelForImageTextToText.from_pretrained`); no peft needed.\n"
    )
