"""Runs of the real training loop for the end-to-end benchmarks (``bench_e2e``, ``bench_staleness``).

* :func:`prepare_assets` builds the demo data set and the warm-started tiny Qwen2.5-VL once, under
  ``benchmarks/.work/`` (gitignored); every run gets its own copy of that model.
* :func:`run_up` runs ``streamgrpo up --config demo`` (or another config) in a subprocess with a wall-clock cap
  (SIGINT to ``up`` by PID when the cap is hit: it stops its children and still writes
  ``summary.json``), then reads ``metrics.jsonl`` and the generator audit.
* Pure functions over the rows of ``metrics.jsonl`` (``{"step", "time", "group_accuracy", "seconds",
  "groups_trained", ...}``) and the generator audit events: throughput, time and steps to the target
  accuracy, generate/train time per group, the ideal overlap bound.

The TRL run of ``bench_e2e`` writes rows of the same shape, so the same functions score it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_pythonpath
from streamgrpo.runtime.accuracy import (  # noqa: F401 - the benchmarks' vocabulary for run scoring
    TARGET_ACCURACY,
    WINDOW_GROUPS,
    group_accuracies,
    target_reached,
)
from streamgrpo.runtime.jsonl import read_rows

WORK = ROOT / "benchmarks" / ".work"
BENCH_STEPS = 100
"""Optimizer steps per run in ``make bench`` (x 8 groups per step = 800 groups): the demo's 50-group
mean accuracy reached 0.9 after 60-80 steps in our runs, so every run has room to get there."""


# ------------------------------------------------------------------------------- pure functions
def final_accuracy(rows: Sequence[dict[str, Any]], window: int = WINDOW_GROUPS) -> float | None:
    """Mean accuracy of the last ``window`` trained groups."""
    accs = [a for _, _, a in group_accuracies(rows)][-window:]
    return sum(accs) / len(accs) if accs else None


def first_accuracy(rows: Sequence[dict[str, Any]], window: int = WINDOW_GROUPS) -> float | None:
    """Mean accuracy of the first ``window`` trained groups (the warm start)."""
    accs = [a for _, _, a in group_accuracies(rows)][:window]
    return sum(accs) / len(accs) if accs else None


def groups_per_step(row: dict[str, Any]) -> int:
    return len(row.get("group_accuracy") or []) or int(row.get("groups", 0))


def throughput(rows: Sequence[dict[str, Any]]) -> float | None:
    """Steady-state trained groups per second: groups trained after the first step over the time from
    the end of the first step to the end of the last (start-up and the first step excluded)."""
    if len(rows) < 2:
        return None
    dt = float(rows[-1]["time"]) - float(rows[0]["time"])
    groups = sum(groups_per_step(r) for r in rows[1:])
    return groups / dt if dt > 0 else None


def time_to_target(rows: Sequence[dict[str, Any]], target: float = TARGET_ACCURACY,
                   window: int = WINDOW_GROUPS) -> float | None:
    """Seconds from the end of the first optimizer step to :func:`target_reached` (None if never)."""
    hit = target_reached(rows, target, window)
    if hit is None or not rows:
        return None
    return hit[1] - float(rows[0]["time"])


def steps_to_target(rows: Sequence[dict[str, Any]], target: float = TARGET_ACCURACY,
                    window: int = WINDOW_GROUPS) -> int | None:
    hit = target_reached(rows, target, window)
    return None if hit is None else hit[0]


def train_seconds_per_group(rows: Sequence[dict[str, Any]]) -> float | None:
    """Median over steps of the learner's step time (``seconds``) divided by the step's groups."""
    vals = [float(r["seconds"]) / groups_per_step(r) for r in rows[1:] if r.get("seconds") and groups_per_step(r)]
    return statistics.median(vals) if vals else None


def generate_seconds_per_group(events: Sequence[dict[str, Any]]) -> float | None:
    """Median generator busy time per group from a generator audit.

    Events in file order: ``produced`` (one per group, written after its put; ``t`` wall time,
    ``put_s`` seconds the put took, backpressure included) and ``applied`` (weights applied). A
    batch is a run of ``produced`` events with the same ``version``; its busy time is the time since
    the event before it (the previous batch's last put, or the weight application) minus the puts'
    time, i.e. prompt preparation + generation + scoring, without waiting on the queue or for
    weights. Per group = batch busy time / groups in it.
    """
    per_group: list[float] = []
    prev_t: float | None = None
    batch: list[dict[str, Any]] = []

    def close(start: float | None) -> None:
        if start is None or not batch:
            return
        busy = float(batch[-1]["t"]) - start - sum(float(e.get("put_s") or 0.0) for e in batch)
        if busy > 0:
            per_group.append(busy / len(batch))

    start: float | None = None
    for e in events:
        kind = e.get("event")
        if kind == "produced":
            if batch and e.get("version") != batch[-1].get("version"):
                close(start)
                batch, start = [], prev_t
            if not batch:
                start = prev_t
            batch.append(e)
        else:
            close(start)
            batch, start = [], None
        prev_t = float(e["t"])
    close(start)
    return statistics.median(per_group) if per_group else None


def overlap_bound(gen_s: float | None, train_s: float | None) -> float | None:
    """Ideal speed-up of overlapping generation and training: (G + T) / max(G, T)."""
    if not gen_s or not train_s:
        return None
    return (gen_s + train_s) / max(gen_s, train_s)


def summarise_rows(rows: Sequence[dict[str, Any]], target: float = TARGET_ACCURACY,
                   window: int = WINDOW_GROUPS) -> dict[str, Any]:
    """The per-run numbers the benchmarks report."""
    hit = target_reached(rows, target, window)
    return {
        "steps": int(rows[-1]["step"]) if rows else 0,
        "groups_trained": sum(groups_per_step(r) for r in rows),
        "groups_per_s": throughput(rows),
        "first_accuracy": first_accuracy(rows, window),
        "final_accuracy": final_accuracy(rows, window),
        "time_to_target_s": None if hit is None else hit[1] - float(rows[0]["time"]),
        "steps_to_target": None if hit is None else hit[0],
        "train_s_per_group": train_seconds_per_group(rows),
        "staleness_mean": (statistics.mean(float(r.get("staleness_mean") or 0.0) for r in rows) if rows else None),
        "target": target, "window_groups": window,
    }


# --------------------------------------------------------------------------------------- files
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return read_rows(path)[0]  # a line cut short by a stop is skipped


def bench_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": child_pythonpath()})
    return env


def data_paths(work: Path = WORK) -> dict[str, Path]:
    return {"train": work / "data" / "train.jsonl", "train_image": work / "data" / "train_image.jsonl",
            "model": work / "model"}


def asset_recipe(config: str) -> dict[str, Any]:
    """The settings of ``config`` that the demo data set and the warm-started model are built from."""
    from streamgrpo.config import load_config

    cfg = load_config(config)
    d = cfg.data
    return {"seed": cfg.seed, "warm_letters": cfg.demo.warm_letters, "warm_pixels": cfg.demo.warm_pixels,
            "demo_size": cfg.demo.size, "demo_task": cfg.demo.task, "demo_frames": cfg.demo.frames,
            "demo_motion": cfg.demo.motion, "kinds": d.kinds, "min_frames": d.min_frames, "max_frames": d.max_frames,
            "min_pixels": d.min_pixels, "max_pixels": d.max_pixels, "prompt_format": d.prompt_format}


def prepare_assets(work: Path = WORK, config: str = "demo") -> dict[str, Path]:
    """Build ``config``'s demo data set and warm-started tiny model once (in a subprocess, one thread).

    ``work/recipe.json`` records what they were built from (:func:`asset_recipe`); when ``config``
    has changed since, both are built again (a model warmed for another resolution or letter target
    would otherwise be measured as if it were the shipped one).
    """
    paths = data_paths(work)
    recipe, stamp = asset_recipe(config), work / "recipe.json"
    built = (paths["model"] / "config.json").exists() and paths["train"].exists() and \
        (paths["train_image"].exists() or recipe["demo_task"] == "needle")  # the needle set has no image twins
    if built and stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return paths
    if built:
        print(f"# {work}: built from other settings than {config!r} now has; building again", flush=True)
    for stale in (paths["model"], paths["train"].parent):
        shutil.rmtree(stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    code = ("from streamgrpo.config import load_config; from streamgrpo.recipes.demo.assets import prepare_assets; "
            f"prepare_assets(load_config({config!r}, ['model.name_or_path={paths['model']}', "
            f"'data.train_path={paths['train']}']))")
    subprocess.run([sys.executable, "-c", code], check=True, env=bench_env(), cwd=ROOT)
    stamp.write_text(json.dumps(recipe, sort_keys=True))
    return paths


def copy_model(src: Path, run_dir: Path) -> Path:
    dst = run_dir / "model"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@dataclass
class LoopRun:
    """One finished run: its rows, generator audit events, ``summary.json`` and how it ended."""

    name: str
    run_dir: Path
    rows: list[dict[str, Any]]
    gen_events: list[dict[str, Any]]
    summary: dict[str, Any]
    wall_s: float
    capped: bool
    returncode: int | None
    stats: dict[str, Any] = field(default_factory=dict)


def stop_by_pid(proc: subprocess.Popen, grace_s: float = 90.0) -> None:
    """SIGINT (``up`` stops its children and writes the summary), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 30.0), (signal.SIGKILL, 30.0)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def fresh_run_dir(run_dir: Path, model: Path) -> Path:
    """Empty ``run_dir`` (removed first if it exists) holding a fresh copy of ``model``; returns the copy."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return copy_model(model, run_dir)


def run_parallel(jobs: Sequence[tuple[str, Path, Sequence[str]]], parallel: int, cap_s: float,
                 log_name: str = "lockstep.log") -> dict[str, dict[str, Any]]:
    """Run ``(key, run_dir, argv)`` jobs ``parallel`` at a time (one torch thread each), each killed by its
    own PID after ``cap_s`` seconds; returns ``{key: {"rows", "wall_s", "capped"}}`` from each
    ``run_dir/metrics.jsonl`` (a failed run with no rows prints its log's tail)."""
    todo = list(jobs)
    running: dict[str, tuple[subprocess.Popen, float, Path, Any]] = {}
    done: dict[str, dict[str, Any]] = {}
    while todo or running:
        while todo and len(running) < parallel:
            key, run_dir, argv = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / log_name, "wb")
            running[key] = (subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=bench_env(1),
                                             cwd=ROOT), time.time(), run_dir, log)
        time.sleep(0.5)
        for key, (proc, t0, run_dir, log) in list(running.items()):
            capped = time.time() - t0 > cap_s
            if proc.poll() is None and not capped:
                continue
            if proc.poll() is None:
                proc.kill()  # by its own PID
                proc.wait()
            log.close()
            del running[key]
            rows = read_jsonl(run_dir / "metrics.jsonl")
            if proc.returncode not in (0, None) and not rows:
                tail = (run_dir / log_name).read_text(errors="replace")[-1500:]
                print(f"# {key}: failed (exit {proc.returncode}); log ends:\n{tail}", flush=True)
            done[key] = {"rows": rows, "wall_s": time.time() - t0, "capped": capped}
    return done


def run_capped(argv: Sequence[str], log_path: Path, cap_s: float, *, threads: int = 1,
               grace_s: float = 90.0) -> tuple[int | None, bool]:
    """Run ``argv`` with its output in ``log_path``; after ``cap_s`` seconds stop it by PID
    (:func:`stop_by_pid`). Returns ``(returncode, capped)``."""
    capped = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=bench_env(threads), cwd=ROOT)
        try:
            proc.wait(cap_s)
        except subprocess.TimeoutExpired:
            capped = True
            stop_by_pid(proc, grace_s)
        except BaseException:
            stop_by_pid(proc, grace_s)
            raise
    return proc.returncode, capped


def run_up(name: str, run_dir: Path, *, model: Path, train: Path, sets: Sequence[str] = (), sync: bool = False,
           generators: int = 1, cap_s: float = 600.0, threads: int = 1, config: str = "demo") -> LoopRun:
    """``streamgrpo up --config <config>`` on a fresh copy of ``model``, capped at ``cap_s`` seconds."""
    model_copy = fresh_run_dir(run_dir, model)
    argv = [sys.executable, "-m", "streamgrpo", "up", "--config", config, "--run-dir", str(run_dir),
            "--generators", str(generators)]
    if sync:
        argv.append("--sync")
    for s in [f"model.name_or_path={model_copy}", "demo.tiny_model=false", f"data.train_path={train}",
              "demo.make_data=false", "learner.save_steps=100000", "eval.enabled=false", *sets]:
        argv += ["--set", s]
    t0 = time.time()
    returncode, capped = run_capped(argv, run_dir / "up.log", cap_s, threads=threads)
    wall = time.time() - t0
    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "audit" / "generator-0.jsonl")
    run = LoopRun(name, run_dir, rows, events, summary, wall, capped, returncode)
    run.stats = summarise_rows(rows)
    run.stats["gen_s_per_group"] = generate_seconds_per_group(events)
    run.stats["wall_s"] = wall
    run.stats["capped"] = capped
    run.stats["groups_dropped"] = summary.get("groups_dropped")
    if not rows:
        tail = (run_dir / "up.log").read_text(errors="replace")[-2000:]
        print(f"# {name}: no training steps recorded (exit {returncode}); up.log ends:\n{tail}", flush=True)
    return run
