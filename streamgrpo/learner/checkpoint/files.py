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

DeepSpeed learners (several ranks) add ``deepspeed/state/``: what DeepSpeed's own
``save_checkpoint`` writes on every rank (the module states and one ZeRO optimizer shard per
rank), under DeepSpeed's file names (``mp_rank_00_model_states.pt``,
``zero_pp_rank_R_mp_rank_00_optim_states.pt``) but *not* in torch.save/pickle format:
:class:`SafeTensorsCheckpointEngine` replaces DeepSpeed's checkpoint engine and stores each state
tree as one safetensors file (tensors) whose metadata holds a JSON skeleton (everything else).
Objects that are neither tensors nor plain data are stored as class name + attributes and
restored only for classes of the ``deepspeed`` package (its loss scaler, fragment addresses,
enums), so loading never runs code named by the file. Per-rank RNG states go to
``rng-rank<R>.safetensors`` / ``rng-rank<R>.json`` (rank 0 also writes ``rng.safetensors``).
"""

from __future__ import annotations

import enum
import importlib
import json
import logging
import os
import random
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from streamgrpo.models.files import read_model_tensors, to_model_names

log = logging.getLogger(__name__)


def _optimizer_to_flat(opt: torch.optim.Optimizer, to_cpu: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's state as ``state.<param index>.<name>`` tensors (on the CPU, or where they live with
    ``to_cpu=False``: the asynchronous path copies them itself) and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous() if to_cpu else value.detach()
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


def staging_dir(ckpt_root: str | Path, step: int) -> Path:
    """A fresh, empty ``step-N.tmp`` under ``ckpt_root`` (one process creates it, every rank writes into it)."""
    tmp = Path(ckpt_root) / f"step-{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def fsync_tree(folder: str | Path) -> None:
    """Make ``folder`` durable: every file under it, then every directory (children first) including it."""
    for dirpath, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def fsync_path(path: str | Path) -> None:
    """``fsync`` a file or a directory by path (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_checkpoint(ckpt_root: str | Path, step: int, total_limit: int | None = None) -> Path:
    """Make the complete ``step-N.tmp`` durable (every file and folder fsynced), rename it to ``step-N``,
    make the rename durable, and prune to the newest ``total_limit``. Only then may the queue commit
    the groups it holds: a host crash cannot leave a newest checkpoint that lacks what Redis deleted."""
    root = Path(ckpt_root)
    final, tmp = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_path(root)
    if total_limit:
        for old in list_checkpoints(root)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint written: %s", final)
    return final


def save_checkpoint(
    ckpt_root: str | Path, step: int, *, model, processor=None, optimizer=None, scheduler=None,
    state: dict[str, Any] | None = None, model_card: str | None = None, total_limit: int | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically under ``ckpt_root``; prune to ``total_limit`` (one process)."""
    return write_checkpoint(
        ckpt_root, step, model=model, processor=processor, weights=None,
        optimizer=_optimizer_to_flat(optimizer) if optimizer is not None else None,
        scheduler=scheduler.state_dict() if scheduler is not None else None, rng=rng_state(), state=state,
        model_card=model_card, total_limit=total_limit)


def write_checkpoint(
    ckpt_root: str | Path, step: int, *, model, processor=None, weights: dict[str, torch.Tensor] | None,
    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None, scheduler: dict[str, Any] | None,
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]], state: dict[str, Any] | None = None,
    model_card: str | None = None, total_limit: int | None = None,
) -> Path:
    """Write checkpoint ``step`` from its parts: ``weights`` (host copies; None: the model's live ones),
    the optimizer's flat ``(tensors, meta)``, the scheduler's state, the RNG ``(tensors, meta)``; the
    asynchronous path (:mod:`streamgrpo.learner.checkpoint.background`) calls it from a background thread."""
    tmp = staging_dir(ckpt_root, step)
    if weights is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(tmp)
    meta: dict[str, Any] = {"step": step, **(state or {})}
    if optimizer is not None:
        save_file(optimizer[0], str(tmp / "optimizer.safetensors"))
        meta["optimizer"] = optimizer[1]
    if scheduler is not None:
        meta["scheduler"] = scheduler
    save_file(rng[0], str(tmp / "rng.safetensors"))
    meta["rng"] = rng[1]
    write_trainer_state(tmp, meta)
    if model_card:
        (tmp / "README.md").write_text(model_card)
    return commit_checkpoint(ckpt_root, step, total_limit)


def write_trainer_state(ckpt_dir: str | Path, meta: dict[str, Any]) -> None:
    (Path(ckpt_dir) / "trainer_state.json").write_text(json.dumps(meta, default=_json_default))


def save_rank_rng(ckpt_dir: str | Path, rank: int) -> None:
    """This rank's RNG states: ``rng-rank<R>.safetensors`` (torch) + ``rng-rank<R>.json`` (python, numpy)."""
    tensors, meta = rng_state()
    save_file(tensors, str(Path(ckpt_dir) / f"rng-rank{rank}.safetensors"))
    (Path(ckpt_dir) / f"rng-rank{rank}.json").write_text(json.dumps(meta))


def load_rank_rng(ckpt_dir: str | Path, rank: int) -> bool:
    """Restore this rank's RNG states; False (nothing changed) when the checkpoint has none for it."""
    base = Path(ckpt_dir) / f"rng-rank{rank}"
    if not base.with_suffix(".safetensors").exists():
        return False
    set_rng_state(load_file(str(base.with_suffix(".safetensors"))), json.loads(base.with_suffix(".json").read_text()))
    return True


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
        weights = to_model_names(read_model_tensors(ckpt), model.state_dict().keys())
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


# ------------------------------------------------------------ state trees as safetensors (no pickle)
class CheckpointError(RuntimeError):
    """A state tree cannot be written or read back (the message names the file and the path in the tree)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, file too large, permissions): one line; the partial
    ``step-N.tmp`` is removed and nothing is committed, so its groups are trained again after --resume."""


def write_failure(exc: BaseException, ckpt_root: str | Path, step: int) -> CheckpointWriteError | None:
    """The one-line :class:`CheckpointWriteError` of ``exc`` when it is a failed write (an ``OSError``: disk full,
    file too large, permissions; safetensors reports an I/O error as its own type), None for anything else (a bug:
    raised with its own traceback)."""
    from safetensors import SafetensorError

    if not isinstance(exc, (OSError, SafetensorError)):
        return None
    why = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return CheckpointWriteError(
        f"cannot write checkpoint step-{step:06d} in {ckpt_root}: {why}{where}; "
        "nothing was committed: the groups since the last checkpoint stay in Redis and are trained again "
        "after --resume (free space there, or lower learner.save_total_limit)")


class CheckpointUnusable(CheckpointError):
    """The checkpoint to resume from cannot be used (does not load, holds non-finite weights, or is older
    than what Redis already committed): one line that says what to do."""


TRUSTED_MODULES = ("deepspeed.",)
"""Objects of classes from these packages may be restored from a state tree (attributes only; no code runs)."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted_class(name: str, where: str) -> type:
    mod, _, qual = name.partition(":")
    if not mod.startswith(TRUSTED_MODULES):
        raise CheckpointError(f"{where}: class {name!r} is not from a trusted package {TRUSTED_MODULES}")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise CheckpointError(f"{where}: {name!r} is not a class")
    return obj


def _torch_or_bytes_node(x: Any) -> dict | None:
    """The skeleton node of a torch dtype, device or Size or of bytes (pure); None for anything else."""
    if isinstance(x, torch.dtype):
        return {"$": "dtype", "name": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"$": "device", "name": str(x)}
    if isinstance(x, torch.Size):
        return {"$": "size", "items": list(x)}
    if isinstance(x, bytes):
        return {"$": "bytes", "hex": x.hex()}
    return None


def _trusted_node(x: Any, path: str, enc: Callable[[Any, str], Any]) -> dict:
    """The skeleton node of an object of a :data:`TRUSTED_MODULES` class (its attributes, or its items
    for a namedtuple); anything else cannot be stored without pickle."""
    cls = type(x)
    if cls.__module__.startswith(TRUSTED_MODULES) and hasattr(x, "__dict__"):
        if isinstance(x, tuple):  # namedtuple
            return {"$": "ntuple", "cls": _qualname(cls), "items": [enc(v, path) for v in x]}
        return {"$": "object", "cls": _qualname(cls), "state": enc(dict(vars(x)), path)}
    raise CheckpointError(f"state tree at {path or '/'}: cannot store a {_qualname(cls)} without pickle")


def pack_tree(obj: Any, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tuples, tensors, numbers, strings, dtypes, enums and
    trusted objects) into ``(tensors, skeleton)``: tensors keyed ``t0, t1, ...`` (contiguous CPU copies;
    ``copy=False``: the live tensors, detached, which the caller copies) and a JSON-able skeleton that
    refers to them. Inverse: :func:`unpack_tree`."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, enum.Enum):
            return {"$": "enum", "cls": _qualname(type(x)), "value": enc(x.value, path)}
        if isinstance(x, (int, float)) and type(x) in (int, float):
            return x
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        if torch.is_tensor(x):
            key = f"t{len(tensors)}"
            tensors[key] = x.detach().to("cpu").contiguous().clone() if copy else x.detach()
            return {"$": "tensor", "key": key}
        if (node := _torch_or_bytes_node(x)) is not None:  # disjoint from the containers below
            return node
        if isinstance(x, (dict, OrderedDict)):
            kind = "odict" if isinstance(x, OrderedDict) else "dict"
            return {"$": kind, "items": [[enc(k, path), enc(v, f"{path}/{k}")] for k, v in x.items()]}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple) and type(x) is tuple:
            return {"$": "tuple", "items": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, (set, frozenset)):
            return {"$": "set", "items": [enc(v, path) for v in sorted(x, key=repr)]}
        return _trusted_node(x, path, enc)

    return tensors, enc(obj, "")


def unpack_tree(tensors: dict[str, torch.Tensor], skeleton: Any, where: str = "<tree>") -> Any:
    """Rebuild what :func:`pack_tree` split; only classes of :data:`TRUSTED_MODULES` are instantiated."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        kind = x.get("$")
        if kind == "tensor":
            return tensors[x["key"]]
        if kind in ("dict", "odict"):
            items = [(_hashable(dec(k)), dec(v)) for k, v in x["items"]]
            return OrderedDict(items) if kind == "odict" else dict(items)
        if kind == "tuple":
            return tuple(dec(v) for v in x["items"])
        if kind == "size":
            return torch.Size(x["items"])
        if kind == "set":
            return {_hashable(dec(v)) for v in x["items"]}
        if kind == "dtype":
            return getattr(torch, x["name"])
        if kind == "device":
            return torch.device(x["name"])
        if kind == "bytes":
            return bytes.fromhex(x["hex"])
        if kind == "enum":
            return _trusted_class(x["cls"], where)(dec(x["value"]))
        if kind == "ntuple":
            return _trusted_class(x["cls"], where)(*[dec(v) for v in x["items"]])
        if kind == "object":
            cls = _trusted_class(x["cls"], where)
            obj = cls.__new__(cls)
            obj.__dict__.update(dec(x["state"]))
            return obj
        raise CheckpointError(f"{where}: unknown node kind {kind!r} in the state tree")

    return dec(skeleton)


def _hashable(x: Any) -> Any:
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x


def save_tree(obj: Any, path: str | Path) -> None:
    """One state tree -> one safetensors file (skeleton in the metadata under ``streamgrpo_tree``)."""
    write_tree(*pack_tree(obj), path)


def write_tree(tensors: dict[str, torch.Tensor], skeleton: Any, path: str | Path) -> None:
    """Write a :func:`pack_tree` split as one safetensors file (renamed into place when complete)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, tmp, metadata={"format": "pt", "streamgrpo_tree": json.dumps(skeleton)})
    os.replace(tmp, path)


def load_tree(path: str | Path, map_location: Any = None) -> Any:
    """Read a file written by :func:`save_tree` (tensors on CPU, or moved to ``map_location``)."""
    device = "cpu"
    if isinstance(map_location, (str, torch.device)):
        device = str(map_location)
    try:
        with safe_open(str(path), framework="pt", device=device) as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # noqa: BLE001 - a torch.save file, a truncated file ...
        raise CheckpointError(f"{path}: not a streamgrpo safetensors state file ({exc})") from None
    if "streamgrpo_tree" not in meta:
        raise CheckpointError(f"{path}: safetensors file without a streamgrpo_tree skeleton")
    return unpack_tree(tensors, json.loads(meta["streamgrpo_tree"]), where=str(path))


class LazyTensor:
    """A tensor of a :func:`save_tree` file, read on demand: a range of its flattened elements (the per-parameter
    consolidation of :mod:`streamgrpo.learner.checkpoint.reshard` reads each parameter's fragments of a ZeRO-3 shard this way,
    never a whole shard)."""

    def __init__(self, fh: Any, key: str):
        self._fh, self.key = fh, key
        self._slice = fh.get_slice(key)
        self.shape = tuple(self._slice.get_shape())

    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def read(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``start .. start+count`` of a 1-D tensor (all of it by default); a 0-d tensor whole."""
        if not self.shape:
            return self._fh.get_tensor(self.key)
        count = self.numel() - start if count is None else count
        return self._slice[start:start + count]


class _LazyTensors(dict):
    def __init__(self, fh: Any):
        super().__init__()
        self._fh = fh

    def __missing__(self, key: str) -> LazyTensor:
        return self.setdefault(key, LazyTensor(self._fh, key))


def open_tree(path: str | Path, stack: Any) -> Any:
    """A :func:`save_tree` file's tree with :class:`LazyTensor` in place of its tensors; the file stays open (memory
    mapped) until ``stack`` (a :class:`contextlib.ExitStack`) closes."""
    try:
        fh = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        meta = fh.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - a torch.save file, a truncated file ...
        raise CheckpointError(f"{path}: not a streamgrpo safetensors state file ({exc})") from None
    if "streamgrpo_tree" not in meta:
        raise CheckpointError(f"{path}: safetensors file without a streamgrpo_tree skeleton")
    return unpack_tree(_LazyTensors(fh), json.loads(meta["streamgrpo_tree"]), where=str(path))


class SafeTensorsCheckpointEngine:
    """DeepSpeed checkpoint engine that writes :func:`save_tree` files instead of ``torch.save`` pickles.

    Install with ``engine.checkpoint_engine = SafeTensorsCheckpointEngine()`` after
    ``deepspeed.initialize``; ``engine.save_checkpoint`` / ``engine.load_checkpoint`` then go
    through it on every rank (same file names as DeepSpeed's own engine).

    Capturing (:meth:`capturing`, the asynchronous checkpoints of :mod:`streamgrpo.learner.checkpoint.ranks`):
    :meth:`save` copies each state tree's tensors to host buffers and keeps ``(path, tensors, skeleton)`` in
    :attr:`captured` instead of writing; a background thread writes them later with :func:`write_tree`. The
    engine stays coupled for DeepSpeed (:meth:`is_decoupled` is False): DeepSpeed's decoupled protocol commits
    inside the next ``engine.step()`` behind a barrier, which would stall that step for the whole write and
    hide the moment the files are durable, which is when the learner commits in Redis.
    """

    name = "streamgrpo-safetensors"

    def __init__(self, config_params: Any = None):
        self._commit_info = None
        self.captured: list[tuple[str, dict[str, torch.Tensor], Any]] | None = None
        self._buffers: Any = None
        self._deferring = False
        self.failed: BaseException | None = None
        """The first error of this rank's part since :meth:`capturing` / :meth:`writing` (kept, not raised: the
        ranks agree on it once DeepSpeed's ``save_checkpoint``, and its collectives, are over on every rank)."""

    @classmethod
    def install(cls, engine: Any) -> SafeTensorsCheckpointEngine:
        """Make one of these ``engine``'s checkpoint engine. DeepSpeed's copy of its recovery scripts (rank 0, plain
        file I/O inside ``save_checkpoint``, between its barriers) goes through :meth:`kept` too."""
        ours = cls()
        engine.checkpoint_engine = ours
        copy = getattr(engine, "_copy_recovery_script", None)
        if callable(copy):
            engine._copy_recovery_script = lambda save_path: ours.kept(copy, save_path)
        return ours

    def capturing(self, buffers: Any, failed: BaseException | None = None) -> None:
        """Capture (do not write) the trees of the next saves into ``buffers`` (a
        :class:`~streamgrpo.learner.checkpoint.background.HostBuffers`), until :meth:`captures` returns them; an error
        is kept in :attr:`failed` (``failed``: this rank's part failed already: capture nothing more)."""
        self.captured, self._buffers, self._deferring, self.failed = [], buffers, True, failed

    def captures(self) -> list[tuple[str, dict[str, torch.Tensor], Any]]:
        """What was captured since :meth:`capturing`; saves write (and raise) again from now on."""
        out, self.captured, self._buffers, self._deferring = self.captured or [], None, None, False
        return out

    def writing(self) -> None:
        """Write the next saves, keeping the first error in :attr:`failed` instead of raising it (the ranks'
        synchronous checkpoint), until :meth:`written`; after an error this rank writes nothing more."""
        self._deferring, self.failed = True, None

    def written(self) -> BaseException | None:
        """End :meth:`writing`: the first error of this rank's writes since, None when they all succeeded."""
        self._deferring = False
        return self.failed

    def kept(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; while capturing or writing, an error is kept in :attr:`failed` (and nothing more runs
        after one) instead of raised."""
        if not self._deferring:
            return fn(*args)
        if self.failed is not None:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - kept for the ranks' agreement (see failed)
            self.failed = exc
            return None

    def create(self, info: Any) -> None:
        self._commit_info = info

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.kept(lambda: os.makedirs(path, exist_ok=exist_ok))

    def save(self, state_dict: Any, path: str) -> None:
        self.kept(self._save, state_dict, path)

    def _save(self, state_dict: Any, path: str) -> None:
        if self.captured is None:
            save_tree(state_dict, path)
            return
        tensors, skeleton = pack_tree(state_dict, copy=False)
        host = self._buffers.copy(tensors, prefix=f"{os.path.basename(path)}/", tied=False)
        self.captured.append((path, host, skeleton))

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_tree(path, map_location)

    def commit(self, info: Any) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: Any) -> None:
        self._commit_info = info

    def get_commit_info(self) -> Any:
        return self._commit_info

    def cleanup(self) -> None:
        return None

    def preserves_storage_sharing(self) -> bool:
        return False  # save() copies every tensor on its own (safetensors refuses shared storage anyway)
