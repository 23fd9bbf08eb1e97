"""Resume on another number of learner ranks: a checkpoint's optimizer state, consolidated per parameter.

A checkpoint holds the optimizer state in the layout of the ranks that wrote it: the torch backend
one ``optimizer.safetensors`` (one process, every parameter), DeepSpeed ZeRO-1/2/3 one flat partition
per rank and parameter group (``deepspeed/state/*zero_pp_rank_R_*optim_states.pt``, written by
:class:`~streamgrpo.learner.checkpoint.files.SafeTensorsCheckpointEngine`). DeepSpeed itself loads only
its own layout on the same number of ranks. When the ranks (or the backend, or the ZeRO stage)
differ, the learner instead:

1. consolidates the saved state per parameter name (:func:`consolidate_zero12`, :func:`consolidate_zero3`,
   :func:`consolidate_torch`): the fp32 master weight, ``exp_avg``, ``exp_avg_sq`` and the optimizer's step
   count, as DeepSpeed's own ``ds_to_universal`` does it (ZeRO-1/2: the fragment of each parameter in each
   rank's flat partition is recorded in the shard as ``param_slice_mappings``; ZeRO-3: every parameter is cut
   into equal partitions, one per rank, laid one after the other in the order of the ``param_shapes`` of
   ``zero_pp_rank_0_mp_rank_00_model_states.pt``); a rank reads only the parameters, under ZeRO-3 only the
   ranges of them, it will hold;
2. writes them into the new layout: the torch optimizer (:func:`apply_to_torch`), this rank's ZeRO-1/2
   partitions through DeepSpeed's ``safe_set_full_*`` functions (:func:`apply_to_zero12`), or its ZeRO-3
   partitions through ``safe_set_local_*`` (:func:`apply_to_zero3`; the weights themselves go in through
   ``deepspeed.zero.GatheredParameters``, :meth:`~streamgrpo.learner.trainer.Learner.load_weights_only`).

DeepSpeed's own converter (``ds_to_universal``, then ``load_universal``) reads and writes ``torch.save``
pickles, which these checkpoints never hold; the arithmetic here is that converter's, the setters are
DeepSpeed's.

What cannot be done is refused before DeepSpeed loads anything, in one line that names a command that works
(:func:`reshard_refusal`): shards missing on disk, a ZeRO-0 state, DeepSpeed's "elastic" optimizer format.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamgrpo.learner.checkpoint.files import load_tree, open_tree

STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state tensors (besides the fp32 master weight, key ``fp32``)."""

DS_PREFIX = "policy."
"""DeepSpeed names the parameters of the module it wraps (:class:`~streamgrpo.learner.trainer.PolicyLogprobs`)."""

_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")

ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
"""Rank 0's module file of a ZeRO-3 checkpoint: the ``param_shapes`` that lay out every shard, the lr schedule."""

FRESH = "streamgrpo learner --config <config> --fresh --from-weights {ckpt}"
"""The command that starts over from a checkpoint's weights (a fresh optimizer) on any ranks, at any ZeRO stage."""


@dataclass
class ParamStates:
    """Optimizer state per parameter name (the policy module's names): ``{"fp32", "exp_avg", "exp_avg_sq"}``
    full-shape float32 tensors, and the number of optimizer steps taken (AdamW's bias correction)."""

    step: int
    tensors: Mapping[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def piece(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements ``lo .. hi`` of parameter ``name``'s flattened ``key`` state (None when it has none)."""
        src = self.tensors.get(name)
        if src is None or key not in src:
            return None
        return src[key].reshape(-1)[lo:hi].float()

    def close(self) -> None:
        """Release what the states read from (the ZeRO-3 shards stay open until then)."""


def zero_shards(ds_state: Path) -> dict[int, Path]:
    """The ZeRO optimizer shards under ``deepspeed/state``, by data-parallel rank."""
    if not ds_state.is_dir():
        return {}
    found = {int(m.group(1)): p for p in ds_state.iterdir() if (m := _SHARD.match(p.name))}
    return dict(sorted(found.items()))


def reshard_refusal(ckpt: Path, meta: dict[str, Any], *, zero_stage: int, world_size: int) -> str | None:
    """Why the checkpoint ``ckpt`` cannot be resumed on ``world_size`` ranks at ``zero_stage`` (0: the torch
    backend or ZeRO-0) through the consolidated path, or None when it can (pure but for listing the folder).
    Every line names a command that works: the ranks that wrote it, or a fresh start from its weights."""
    saved_ws = int(meta.get("world_size", 1))
    fresh = FRESH.format(ckpt=ckpt)
    ds_dir = ckpt / "deepspeed" / "state"
    if meta.get("backend", "torch") != "deepspeed" or not ds_dir.is_dir():
        return None if (ckpt / "optimizer.safetensors").is_file() or meta.get("backend") == "deepspeed" else (
            f"{ckpt} has no optimizer.safetensors: start from its weights with {fresh} (a fresh optimizer)")
    saved_stage = int(meta.get("zero_stage", -1))
    shards = zero_shards(ds_dir)
    if not shards:
        what = "no ZeRO optimizer shards (ZeRO-0)" if saved_stage == 0 else "no ZeRO optimizer shards"
        return (f"{ckpt} holds {what}: it resumes only on {saved_ws} rank(s) (torchrun --nproc-per-node "
                f"{saved_ws} -m streamgrpo learner --config <config> --resume); or start from its weights with "
                f"{fresh} (a fresh optimizer)")
    if sorted(shards) != list(range(saved_ws)):
        return (f"{ckpt}: {len(shards)} ZeRO optimizer shard(s) on disk (ranks {sorted(shards)}) but it was written "
                f"by {saved_ws} rank(s): it is incomplete; resume from an earlier checkpoint, or start from its "
                f"weights with {fresh}")
    if saved_stage >= 3 and not (ds_dir / ZERO3_MODEL_STATES).is_file():
        return (f"{ckpt}: a ZeRO-3 state without {ZERO3_MODEL_STATES} (the layout of its shards): it is "
                f"incomplete; resume from an earlier checkpoint, or start from its weights with {fresh}")
    return None


# ------------------------------------------------------------------------------- consolidate
def _step_of(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    if hasattr(step, "read"):  # a LazyTensor of a ZeRO-3 shard
        step = step.read()
    return int(step.item() if torch.is_tensor(step) else step)


def merge_zero12_shard(tree: dict[str, Any], wanted: set[str] | None, pieces: dict[str, dict[str, list]]) -> int:
    """Take one ZeRO-1/2 rank's fragments of the ``wanted`` parameters (DeepSpeed names; None: all) out of its
    optimizer shard ``tree`` into ``pieces[name][key]`` (in rank order); returns the shard's step count."""
    osd = tree["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    if not isinstance(base, dict):
        raise ValueError("DeepSpeed's elastic_checkpoint optimizer format cannot be consolidated; "
                         "set zero_optimization.elastic_checkpoint=false")
    step = 0
    for g, mapping in enumerate(osd["param_slice_mappings"]):
        flat_fp32 = osd["single_partition_of_fp32_groups"][g]
        state = base["state"].get(base["param_groups"][g]["params"][0], {})
        step = max(step, _step_of(state))
        flats = {"fp32": flat_fp32, **{k: state[k] for k in STATE_KEYS if k in state}}
        for name, addr in mapping.items():
            if wanted is not None and name not in wanted:
                continue
            slot = pieces.setdefault(name, {})
            for key, flat in flats.items():
                slot.setdefault(key, []).append(flat.narrow(0, addr.start, addr.numel).clone())
    return step


def consolidate_zero12(ds_state: Path, shapes: dict[str, torch.Size], wanted: Iterable[str] | None = None) -> ParamStates:
    """The per-parameter state of a ZeRO-1/2 checkpoint (``deepspeed/state``), for the module parameter names
    ``wanted`` (None: all); ``shapes``: module name -> shape. Shards are read one at a time."""

    want = None if wanted is None else {DS_PREFIX + n for n in wanted}
    pieces: dict[str, dict[str, list]] = {}
    step = 0
    for _rank, path in zero_shards(ds_state).items():
        step = max(step, merge_zero12_shard(load_tree(path), want, pieces))
    out = ParamStates(step=step)
    for ds_name, slots in pieces.items():
        name = ds_name.removeprefix(DS_PREFIX)
        shape = shapes.get(name)
        if shape is None:
            raise ValueError(f"{ds_state}: parameter {name!r} is not in this model")
        out.tensors[name] = {}
        for key, parts in slots.items():
            flat = torch.cat(parts)
            if flat.numel() != shape.numel():
                raise ValueError(f"{ds_state}: {name}.{key} has {flat.numel()} elements in the shards, the model "
                                 f"{shape.numel()}")
            out.tensors[name][key] = flat.view(shape).float()
    if want is not None and (absent := sorted(n.removeprefix(DS_PREFIX) for n in want - set(pieces))):
        raise ValueError(f"{ds_state}: no optimizer state for {len(absent)} trainable parameter(s), e.g. {absent[:3]}")
    return out


def zero3_partition(numel: int, ranks: int) -> int:
    """The elements of a parameter that each of ``ranks`` ZeRO-3 ranks holds, the last one's padded with zeros
    (DeepSpeed's ``zero3_partitioned_param_info``)."""
    return -(-numel // ranks)


@dataclass
class _Slot:
    group: int  # the sub-group (flat partition) of every rank that holds the parameter
    offset: int  # where its partition starts in that flat partition
    shape: torch.Size


class _Zero3Tensors(Mapping):
    """``name -> {"fp32", "exp_avg", "exp_avg_sq"}`` of whole parameters, read from the shards on access."""

    def __init__(self, states: Zero3States, names: list[str]):
        self._states, self._names = states, set(names)
        self._order = names

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._names:
            raise KeyError(name)
        numel = self._states.slots[name].shape.numel()
        return {key: self._states.piece(name, key, 0, numel).view(self._states.slots[name].shape)
                for key in self._states.keys}

    def __contains__(self, name: object) -> bool:  # without reading the parameter (Mapping's would)
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._names)


class Zero3States(ParamStates):
    """The per-parameter state of a ZeRO-3 checkpoint, read on demand from its shards (memory mapped, one
    safetensors file per rank): :meth:`piece` reads a range of one parameter from the ranks that hold it,
    ``tensors[name]`` a whole one. :meth:`close` when done."""

    def __init__(self, ds_state: Path, shapes: dict[str, torch.Size], wanted: Iterable[str] | None = None):

        self._stack = ExitStack()
        shards = zero_shards(ds_state)
        self.ranks = len(shards)
        layout = load_tree(ds_state / ZERO3_MODEL_STATES)["param_shapes"]
        self.slots: dict[str, _Slot] = {}
        sizes = []
        for g, group in enumerate(layout):
            offset = 0
            for ds_name, shape in group.items():
                name = ds_name.removeprefix(DS_PREFIX)
                if name in shapes and torch.Size(shapes[name]).numel() != torch.Size(shape).numel():
                    raise ValueError(f"{ds_state}: parameter {name!r} has shape {tuple(shape)} in the checkpoint, "
                                     f"{tuple(shapes[name])} in this model")
                self.slots[name] = _Slot(g, offset, torch.Size(shapes.get(name, shape)))
                offset += zero3_partition(torch.Size(shape).numel(), self.ranks)
            sizes.append(offset)
        self.flats: list[dict[str, list]] = []  # per saved rank: key -> the lazy flat partition of each sub-group
        step = 0
        try:
            for path in shards.values():
                osd = open_tree(path, self._stack)["optimizer_state_dict"]
                if int(osd.get("partition_count", self.ranks)) != self.ranks:
                    raise ValueError(f"{path}: partitioned over {osd['partition_count']} rank(s), {self.ranks} "
                                     "shard(s) on disk")
                flats = {"fp32": list(osd["fp32_flat_groups"])}
                base = osd["optimizer_state_dict"]["state"]
                for key in STATE_KEYS:
                    if all(key in base.get(g, {}) for g in range(len(sizes))):
                        flats[key] = [base[g][key] for g in range(len(sizes))]
                if [t.numel() for t in flats["fp32"]] != sizes:
                    raise ValueError(f"{path}: flat partitions of {[t.numel() for t in flats['fp32']]} element(s), "
                                     f"the parameters of {ZERO3_MODEL_STATES} make {sizes} on {self.ranks} rank(s)")
                step = max([step] + [_step_of(base[g]) for g in base if "step" in base[g]])
                self.flats.append(flats)
        except BaseException:
            self._stack.close()
            raise
        self.keys = tuple(k for k in ("fp32", *STATE_KEYS) if all(k in f for f in self.flats))
        names = list(self.slots) if wanted is None else list(wanted)
        if absent := sorted(set(names) - set(self.slots)):
            self._stack.close()
            raise ValueError(f"{ds_state}: no optimizer state for {len(absent)} trainable parameter(s), e.g. "
                             f"{absent[:3]}")
        super().__init__(step=step, tensors=_Zero3Tensors(self, names))

    def piece(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor | None:
        slot = self.slots.get(name)
        if slot is None or key not in self.keys:
            return None
        numel = slot.shape.numel()
        part = zero3_partition(numel, self.ranks)
        hi = min(hi, numel)
        out = []
        for rank in range(lo // part, -(-hi // part)) if hi > lo else ():
            a, b = max(lo, rank * part), min(hi, (rank + 1) * part)
            out.append(self.flats[rank][key][slot.group].read(slot.offset + a - rank * part, b - a))
        return torch.cat(out).float() if out else torch.zeros(0)

    def close(self) -> None:
        self._stack.close()


def consolidate_zero3(ds_state: Path, shapes: dict[str, torch.Size], wanted: Iterable[str] | None = None) -> Zero3States:
    """The per-parameter state of a ZeRO-3 checkpoint (``deepspeed/state``), read on demand (:class:`Zero3States`)."""
    return Zero3States(ds_state, shapes, wanted)


def consolidate_torch(ckpt: Path, meta: dict[str, Any], names_now: list[str],
                      weights: dict[str, torch.Tensor], wanted: Iterable[str] | None = None) -> ParamStates:
    """The per-parameter state of a torch-backend checkpoint: ``optimizer.safetensors`` (keyed by the
    optimizer's parameter index; the names in that order are in ``trainer_state.json``, else ``names_now``,
    this learner's trainable names in optimizer order) and the fp32 master weights from ``weights``."""
    from safetensors.torch import load_file

    opt = meta.get("optimizer") or {}
    names = meta.get("param_names") or names_now
    want = None if wanted is None else set(wanted)
    raw = load_file(str(ckpt / "optimizer.safetensors"))
    order = [i for g in opt.get("param_groups", []) for i in g["params"]]
    if len(order) != len(names):
        raise ValueError(f"{ckpt}: the optimizer holds {len(order)} parameters and the model trains {len(names)}")
    by_index = dict(zip(order, names))
    out = ParamStates(step=0)
    for key, tensor in raw.items():
        _, idx, what = key.split(".", 2)
        name = by_index[int(idx)]
        if want is None or name in want:
            if what == "step":
                out.step = max(out.step, int(tensor.item()))
            else:
                out.tensors.setdefault(name, {})[what] = tensor.float()
    for name in list(out.tensors):
        out.tensors[name]["fp32"] = weights[name].float()
    return out


# ------------------------------------------------------------------------------------ apply
def _adam_step(step: int, flat: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """AdamW's ``step`` entry as torch keeps it (on the parameter's device for the fused/capturable kernels)."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(float(step), dtype=torch.float32, device=flat.device if on_device else "cpu")


def apply_to_torch(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]],
                   states: ParamStates) -> int:
    """Write ``states`` into a torch AdamW over ``named`` (fp32 weights included); returns the parameters set."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    done = 0
    with torch.no_grad():
        for name, p in named:
            src = states.tensors.get(name)
            if src is None or id(p) not in group_of:
                continue
            p.copy_(src["fp32"].to(p.dtype))
            entry = {"step": _adam_step(states.step, p, group_of[id(p)])}
            for key in STATE_KEYS:
                entry[key] = src[key].to(device=p.device, dtype=torch.float32).clone() if key in src else \
                    torch.zeros_like(p, dtype=torch.float32)
            optimizer.state[p] = entry
            done += 1
    return done


def apply_to_zero3(zero_optimizer, named: list[tuple[str, torch.nn.Parameter]], states: ParamStates) -> int:
    """Write ``states`` into this rank's ZeRO-3 partitions of the fp32 master weights and AdamW's moments
    (DeepSpeed's ``safe_set_local_*``: each parameter's range this rank holds, padded as DeepSpeed pads it); the
    AdamW state of each flat partition is created first when no step has run yet. Returns the parameters set.
    The model's own (bf16) partitions are the weights, loaded before (``GatheredParameters``)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    inner = zero_optimizer.optimizer
    for g, flat in enumerate(zero_optimizer.fp32_partitioned_groups_flat):
        entry = inner.state[flat]
        entry["step"] = _adam_step(states.step, flat, inner.param_groups[zero_optimizer.sub_group_to_group_id[g]])
        for key in STATE_KEYS:
            entry.setdefault(key, torch.zeros_like(flat))
    done = 0
    for name, p in named:
        if not hasattr(p, "ds_id") or name not in states.tensors:
            continue
        part = p.partition_numel()
        lo = zero_optimizer._get_param_partition_rank(p) * part
        for key in ("fp32", *STATE_KEYS):
            piece = states.piece(name, key, lo, min(lo + part, p.ds_numel))
            if piece is None:
                continue
            value = torch.zeros(part, dtype=torch.float32)
            value[:piece.numel()] = piece
            if key == "fp32":
                safe_set_local_fp32_param(p, value)
            else:
                safe_set_local_optimizer_state(p, value, key)
        done += 1
    return done


def apply_to_zero12(zero_optimizer, named: list[tuple[str, torch.nn.Parameter]], states: ParamStates) -> int:
    """Write ``states`` into this rank's ZeRO-1/2 partitions (DeepSpeed's ``safe_set_full_*``); the AdamW state of
    each flat partition is created first when no step has run yet. Returns the parameters set."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner = zero_optimizer.optimizer
    for g, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        entry = inner.state[flat]
        entry["step"] = _adam_step(states.step, flat, inner.param_groups[g])
        for key in STATE_KEYS:
            entry.setdefault(key, torch.zeros_like(flat))
    zero_optimizer._hp_optimizer_states_linked = False  # link the per-parameter views to the states just made
    zero_optimizer._lazy_init_hp_params_optimizer_state()
    done = 0
    for name, p in named:
        if getattr(p, "_hp_mapping", None) is None:
            continue
        src = states.tensors[name]
        safe_set_full_fp32_param(p, src["fp32"].to(p.device))
        for key in STATE_KEYS:
            if key in src:
                safe_set_full_optimizer_state(p, src[key].to(p.device), key)
        done += 1
    return done
