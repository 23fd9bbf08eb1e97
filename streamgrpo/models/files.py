"""A model directory's tensors as saved (``save_pretrained``: one file, shards, or a peft adapter), and
the checkpoint keys of the original hub layout mapped to the parameter names transformers 5 gives."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_model_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory: ``model.safetensors``, its sharded form
    (``model.safetensors.index.json``) or a peft adapter (``adapter_model.safetensors``)."""
    d = Path(model_dir)
    for single in ("model.safetensors", "adapter_model.safetensors"):
        if (d / single).is_file():
            return load_file(str(d / single))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(str(d / shard)))
        return out
    raise FileNotFoundError(f"{d}: no model.safetensors, model.safetensors.index.json or adapter_model.safetensors")


def to_model_names(tensors: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """Rename checkpoint keys to the model's parameter names.

    transformers 5 saves some Qwen-VL checkpoints in their original hub layout (Qwen2.5-VL:
    ``model.layers.*``, ``visual.*``) while the loaded model names them ``model.language_model.*``
    and ``model.visual.*``; keys that already match are kept.
    """
    names = set(names)
    out = {}
    for key, t in tensors.items():
        out[key if key in names or runtime_name(key) not in names else runtime_name(key)] = t
    return out


def runtime_name(key: str) -> str:
    """The transformers-5 parameter name of a Qwen-VL checkpoint key in the original hub layout."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key
