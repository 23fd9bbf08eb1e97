"""Where ``streamgrpo up`` puts each process of one node: learner ranks and generators on devices.

Pure planning over typed inputs (no torch, no CUDA): :func:`plan_placement` takes the devices, the
rank and generator counts, the sharing rules and what each process needs, and returns a
:class:`PlacementPlan` or raises :class:`PlacementError` with one line that says what to change.

The rules, as TRL's and OpenRLHF's one-node layouts have them:

* with no devices (a CPU machine, or ``--gpus cpu``) every process runs on the CPU;
* the learner's ranks take the first devices, one each;
* generators take the devices after them, ``generators_per_gpu`` to a device (default 1);
* with ``colocate`` generators share the learner's devices instead (and any spare ones), when the
  memory allows;
* the evaluator (``eval.enabled``) takes a device nobody else uses, else shares the last generator's
  (it holds the weights once, in the HF engine, and answers a few held-out records now and then);
* a plan that puts more on a device than it holds (the learner's plan from ``streamgrpo config
  memory``, static parts and a step's; an HF generator's weights, KV cache and logits, or vLLM's
  share of the device) is refused, as
  are more learner ranks than devices and a device used twice without ``colocate`` or
  ``generators_per_gpu``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamgrpo.config import ConfigError


class PlacementError(ConfigError):
    """A placement that cannot work: one line naming the setting to change."""


def parse_gpus(spec: str | None) -> tuple[int, ...] | None:
    """``"0-7"`` / ``"0,2,4-5"`` -> device indices; ``"cpu"`` or ``""`` -> () (no device); None -> None (detect)."""
    if spec is None:
        return None
    text = str(spec).strip().lower()
    if text in ("", "cpu", "none"):
        return ()
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise PlacementError(f"--gpus {spec!r}: expected device numbers and ranges such as 0-7 or 0,1,4-5, "
                                 "or cpu")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise PlacementError(f"--gpus {spec!r}: the range {lo}-{hi} runs backwards")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise PlacementError(f"--gpus {spec!r}: a device is listed twice")
    return tuple(out)


def format_gpus(devices: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``; () -> ``"cpu"``."""
    if not devices:
        return "cpu"
    runs, start = [], None
    for i, d in enumerate(devices):
        if start is None:
            start = d
        if i + 1 == len(devices) or devices[i + 1] != d + 1:
            runs.append(f"{start}" if start == d else f"{start}-{d}")
            start = None
    return ",".join(runs)


@dataclass(frozen=True)
class Proc:
    """One process of the plan: its name, the devices it sees (``CUDA_VISIBLE_DEVICES``; () = CPU), its
    learner ranks (torchrun, one device each) and its static memory per device (None: not known)."""

    name: str
    devices: tuple[int, ...]
    ranks: int = 1
    gib: float | None = None


@dataclass(frozen=True)
class PlacementPlan:
    learner: Proc
    generators: tuple[Proc, ...]
    devices: tuple[int, ...]
    device_gib: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    evaluator: Proc | None = None

    @property
    def processes(self) -> tuple[Proc, ...]:
        return (self.learner, *self.generators, *((self.evaluator,) if self.evaluator else ()))

    def load(self) -> dict[int, list[tuple[str, float | None]]]:
        """Device -> ``(who, GiB)`` of everything placed on it (a learner rank counts on its own device)."""
        out: dict[int, list[tuple[str, float | None]]] = {d: [] for d in self.devices}
        for r, d in enumerate(self.learner.devices):
            out[d].append((f"learner rank {r}" if self.learner.ranks > 1 else "learner", self.learner.gib))
        for g in (*self.generators, *((self.evaluator,) if self.evaluator else ())):
            for d in g.devices:
                out[d].append((g.name, g.gib))
        return out

    def lines(self) -> list[str]:
        """The plan as printed before anything starts (``up --plan`` prints only this)."""
        cap = f" of {self.device_gib:.0f} GiB" if self.device_gib else ""
        rows = [f"placement: {self.learner.ranks} learner rank(s), {len(self.generators)} generator(s)"
                + (", the evaluator" if self.evaluator else "") + " on "
                + (f"GPU {format_gpus(self.devices)}{cap}" if self.devices else "the CPU")]
        if not self.devices:
            return rows + [f"  {p.name}: cpu" + (f" ({p.ranks} ranks)" if p.ranks > 1 else "") for p in self.processes] \
                + [f"  note: {n}" for n in self.notes]
        for d, parts in self.load().items():
            known = [g for _, g in parts if g is not None]
            total = f"  = {sum(known):.1f} GiB" + (" + unknown" if len(known) < len(parts) else "") if known else ""
            who = ", ".join(f"{n} ({g:.1f} GiB)" if g is not None else n for n, g in parts) or "idle"
            rows.append(f"  GPU {d}: {who}{total}")
        return rows + [f"  note: {n}" for n in self.notes]


def plan_placement(*, devices: Sequence[int], learner_ranks: int, generators: int, generators_per_gpu: int = 1,
                   colocate: bool = False, learner_gib: float | None = None, generator_gib: float | None = None,
                   device_gib: float | None = None, evaluator: bool = False,
                   evaluator_gib: float | None = None, vllm_utilization: float | None = None) -> PlacementPlan:
    """Place ``learner_ranks`` learner ranks, ``generators`` generators and with ``evaluator`` the
    evaluator on ``devices`` (see the module docstring). ``learner_gib``: one rank's static memory;
    ``generator_gib``: one generator's; ``evaluator_gib``: the evaluator's; all per device and None when
    not known; ``device_gib``: one device's memory (None: not checked); ``vllm_utilization``: the
    generators' ``rollout.vllm.gpu_memory_utilization`` when they run vLLM (the refusal names it)."""
    devices = tuple(devices)
    if learner_ranks < 1:
        raise PlacementError(f"--learner-ranks {learner_ranks}: at least one learner rank")
    if generators < 0:
        raise PlacementError(f"--generators {generators}: cannot be negative")
    if generators_per_gpu < 1:
        raise PlacementError(f"launch.generators_per_gpu={generators_per_gpu}: at least 1")
    if not devices:  # CPU: nothing to share out
        gens = tuple(Proc(f"generator-{k}", (), gib=generator_gib) for k in range(generators))
        return PlacementPlan(Proc("learner", (), learner_ranks, learner_gib), gens, (),
                             evaluator=Proc("evaluator", (), gib=evaluator_gib) if evaluator else None)
    if learner_ranks > len(devices):
        raise PlacementError(f"{learner_ranks} learner ranks need a GPU each and --gpus names {len(devices)} "
                             f"({format_gpus(devices)}): lower --learner-ranks or name more GPUs")
    learner = Proc("learner", devices[:learner_ranks], learner_ranks, learner_gib)
    notes = []
    if colocate:
        pool = devices[learner_ranks:] + devices[:learner_ranks]  # spare devices first, then the learner's
        notes.append("generators colocated with the learner (launch.colocate)")
    else:
        pool = devices[learner_ranks:]
    capacity = len(pool) * generators_per_gpu
    if generators > capacity:
        need = math.ceil(generators / generators_per_gpu)
        raise PlacementError(
            f"{generators} generator(s) at {generators_per_gpu} per GPU need {need} GPU(s) "
            + ("" if colocate else f"besides the learner's {learner_ranks} ")
            + f"and --gpus {format_gpus(devices)} leaves {len(pool)}: name more GPUs, lower --generators, raise "
            "launch.generators_per_gpu" + ("" if colocate else ", or colocate them with the learner (--colocate)"))
    gens = tuple(Proc(f"generator-{k}", (pool[k // generators_per_gpu],), gib=generator_gib) for k in range(generators))
    ev = None
    if evaluator:
        d = evaluator_device(devices, learner, gens)
        ev = Proc("evaluator", (d,), gib=evaluator_gib)
        if any(d in p.devices for p in (learner, *gens)):
            notes.append(f"the evaluator shares GPU {d} (no GPU is left for it alone)")
    plan = PlacementPlan(learner, gens, devices, device_gib, tuple(notes), ev)
    if device_gib:
        for d, parts in plan.load().items():
            known = sum(g for _, g in parts if g is not None)
            if known > device_gib:
                who = " + ".join(f"{n} {g:.1f}" for n, g in parts if g is not None)
                raise PlacementError(
                    f"GPU {d} would hold {known:.1f} GiB ({who}) of its {device_gib:.0f} GiB: "
                    + generator_advice(parts, device_gib, vllm_utilization)
                    + ("stop colocating (--no-colocate), " if colocate else "")
                    + ("lower launch.generators_per_gpu, " if generators_per_gpu > 1 else "")
                    + ("turn the evaluator off here (eval.enabled=false) and run it elsewhere, " if ev else "")
                    + "use more GPUs, or shrink the learner's plan (streamgrpo config memory)")
    return plan


def generator_advice(parts: Sequence[tuple[str, float | None]], device_gib: float,
                     vllm_utilization: float | None) -> str:
    """The first advice of a refused device when its generators are what overflows it (the rest fits
    alone): vLLM's ``gpu_memory_utilization`` at most what leaves room for the rest, or the HF engine's
    batch; "" otherwise."""
    gens = [g for n, g in parts if n.startswith("generator-") and g is not None]
    rest = sum(g for n, g in parts if not n.startswith("generator-") and g is not None)
    if not gens or rest >= device_gib:
        return ""
    if vllm_utilization is None:
        return ("the generators (hf engine) need less: fewer rollout.prompts_per_batch or a shorter "
                "rollout.max_completion_length, ")
    most = math.floor((device_gib - rest) / (len(gens) * device_gib) * 100) / 100
    if most <= 0.0:
        return ""
    return (f"lower rollout.vllm.gpu_memory_utilization (now {vllm_utilization:g}; at most {most:.2f} leaves room "
            f"for the rest on this GPU), ")


def evaluator_device(devices: Sequence[int], learner: Proc, generators: Sequence[Proc]) -> int:
    """The evaluator's device: the first one no learner rank or generator uses, else the last generator's
    (else the last learner rank's, when there is no generator on a device)."""
    used = {d for p in (learner, *generators) for d in p.devices}
    spare = [d for d in devices if d not in used]
    if spare:
        return spare[0]
    on_device = [p for p in generators if p.devices]
    return on_device[-1].devices[-1] if on_device else learner.devices[-1]


def generator_gib(engine: str, *, params: int | None, dtype_bytes: int, gpu_memory_utilization: float,
                  device_gib: float | None, step_gib: float = 0.0) -> float | None:
    """One generator's memory on its device: vLLM takes ``gpu_memory_utilization`` of the device
    (weights and KV cache); the HF engine its weights and ``step_gib`` (its KV cache, prefill and
    logits: :func:`~streamgrpo.learner.memory.step.generator_memory`). None when it cannot be known."""
    if engine == "vllm":
        return gpu_memory_utilization * device_gib if device_gib else None
    return params * dtype_bytes / (1 << 30) + step_gib if params else None
