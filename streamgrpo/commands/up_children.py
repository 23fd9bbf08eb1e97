"""The processes ``streamgrpo up`` starts and stops: their command lines and devices (:func:`child_specs`, pure),
starting them with their logs in the run directory (:func:`start_children`), and stopping them by PID
(:func:`stop_children`: SIGTERM, then SIGKILL after a grace).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from streamgrpo.config import Config
from streamgrpo.runtime.jsonl import write_json
from streamgrpo.runtime.processes import die_with_parent, stop_processes

CHILD_GRACE_S = 20.0
"""How long a child may take to stop after SIGTERM before `up` kills it."""


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        self._fh = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)  # gone with `up`
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = CHILD_GRACE_S) -> int | None:
        """SIGTERM (finish the current unit of work), then SIGKILL after ``grace_s``; by PID only."""
        return stop_children([self], grace_s)[0]


def stop_children(children: list[Child], grace_s: float = CHILD_GRACE_S) -> list[int | None]:
    """SIGTERM by PID, SIGKILL after ``grace_s``: the generators (and the evaluator) first, side by side, so
    `up` waits for the slowest of them rather than for each in turn; then the learner (``children[0]``),
    which finishes its step and checkpoints. Stopped while the learner still reads, a generator blocked
    on a full queue gets its room at once (it would wait out its grace with the learner gone)."""
    learner, others = children[:1], children[1:]
    try:
        codes = stop_processes([c.proc for c in others], grace_s) + stop_processes([c.proc for c in learner], grace_s)
    finally:
        for c in children:
            c._fh.close()
    return codes[len(others):] + codes[:len(others)]


@dataclass(frozen=True)
class ChildSpec:
    """How ``up`` starts one process: its command line and what it changes in the environment."""

    name: str
    argv: list[str]
    env: dict[str, str]
    metrics_port: int  # 0: a free one, written to <run_dir>/ports/ by the process


def child_specs(cfg: Config, plan, config_path: Path, python: str = sys.executable,
                visible_ids: list[str] | None = None) -> list[ChildSpec]:
    """The learner's and the generators' commands for ``plan`` (pure): torchrun for several learner
    ranks, each process's ``CUDA_VISIBLE_DEVICES`` (``visible_ids``: what this process's device
    indices are called, from its own ``CUDA_VISIBLE_DEVICES``), and with a fixed ``metrics.port`` P
    one port each (learner rank r: P + r; generator k: P + ranks + k)."""
    def devices(p) -> str:
        return ",".join(visible_ids[d] if visible_ids else str(d) for d in p.devices)

    base, learner = [python, "-m", "streamgrpo"], plan.learner
    head = [python, "-m", "streamgrpo.learner.ranks", "--standalone", "--nproc-per-node", str(learner.ranks), "-m",
            "streamgrpo"] if learner.ranks > 1 else base
    port = cfg.metrics.port
    specs = [ChildSpec("learner", [*head, "learner", "--config", str(config_path)],
                       {"CUDA_VISIBLE_DEVICES": devices(learner)}, port)]
    for k, g in enumerate(plan.generators):
        gport = port + learner.ranks + k if port else 0
        extra = ["--set", f"metrics.port={gport}"] if port else []
        specs.append(ChildSpec(g.name, [*base, "generator", "--config", str(config_path), "--id", str(k), *extra],
                               {"CUDA_VISIBLE_DEVICES": devices(g)}, gport))
    if plan.evaluator is not None:
        eport = port + learner.ranks + len(plan.generators) if port else 0
        extra = ["--set", f"metrics.port={eport}"] if port else []
        specs.append(ChildSpec("evaluator", [*base, "evaluator", "--config", str(config_path), *extra],
                               {"CUDA_VISIBLE_DEVICES": devices(plan.evaluator)}, eport))
    return specs


def start_children(cfg: Config, rd: Path, config_path: Path, env: dict[str, str], plan) -> list[Child]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",")] if visible else None
    children = [Child(s.name, s.argv, rd / "logs" / f"{s.name}.log", {**env, **s.env})
                for s in child_specs(cfg, plan, config_path, visible_ids=ids)]
    write_json(rd / "processes.json", {c.name: c.pid for c in children})
    ranks = f" ({plan.learner.ranks} ranks)" if plan.learner.ranks > 1 else ""
    evaluator = " + the evaluator" if plan.evaluator is not None else ""
    print(f"learner{ranks} + {cfg.rollout.num_generators} generators{evaluator} started; logs in {rd / 'logs'}",
          flush=True)
    for line in cfg.advice():
        print(f"note: {line}", flush=True)
    return children
