"""Learner checkpoints: safetensors and JSON only (no pickle).

Layout of ``<run_dir>/checkpoints/step-000120/``:

- the model as ``save_pretrained`` writes it (``model.safetensors``, ``config.json``, processor
  files), so ``from_pretrained(checkpoint_dir)`` works with plain transformers;
- ``optimizer.safetensors`` (every state tensor, keyed ``state.<param index>.<name>``) and
  ``trainer_state.json`` (optimizer param groups, scheduler state, version, step, counters, RNG
  states of python/numpy, trained group ids);
- ``rng.safetensors`` (torch CPU/CUDA generator states as uint8 tensors);
- ``README.md``: the model card.

A checkpoint is written to ``step-N.tmp`` and renamed when complete, so a crash mid-save never
leaves a half checkpoint that ``latest_checkpoint`` would pick.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)


def _optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, extra in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(extra)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    meta = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.random.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = meta["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), npst[2], npst[3], npst[4]))


def save_checkpoint(
    ckpt_root: str | Path, step: int, *, model, processor=None, optimizer=None, scheduler=None,
    state: dict[str, Any] | None = None, model_card: str | None = None, total_limit: int | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically under ``ckpt_root``; prune to ``total_limit``."""
    root = Path(ckpt_root)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(tmp)
    meta: dict[str, Any] = {"step": step, **(state or {})}
    if optimizer is not None:
        tensors, opt_meta = _optimizer_to_flat(optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta["optimizer"] = opt_meta
    if scheduler is not None:
        meta["scheduler"] = scheduler.state_dict()
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    meta["rng"] = rng_meta
    (tmp / "trainer_state.json").write_text(json.dumps(meta, default=_json_default))
    if model_card:
        (tmp / "README.md").write_text(model_card)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if total_limit:
        for old in list_checkpoints(root)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint written: %s", final)
    return final


def _json_default(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, set):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def load_trainer_state(ckpt: str | Path, *, model=None, optimizer=None, scheduler=None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore optimizer/scheduler/RNG (and model weights when ``model`` is given) from ``ckpt``."""
    ckpt = Path(ckpt)
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    if model is not None:
        weights = load_file(str(ckpt / "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if m not in _tied_names(model)]
        if missing or unexpected:
            raise RuntimeError(f"{ckpt}: checkpoint does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if optimizer is not None and "optimizer" in meta:
        _optimizer_from_flat(optimizer, load_file(str(ckpt / "optimizer.safetensors")), meta["optimizer"])
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng and (ckpt / "rng.safetensors").exists():
        set_rng_state(load_file(str(ckpt / "rng.safetensors")), meta["rng"])
    return meta


def _tied_names(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or []
    return set(tied if isinstance(tied, (list, set, tuple)) else tied.keys())
