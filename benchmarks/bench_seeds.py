"""Learning that does not depend on luck: the motion demo and the needle recipe over many seeds.

Per task and seed, one training run of the shipped config (``demo-motion``: which way a square moves;
``demo-needle``: which colour flashed for 2-4 frames in a 256-frame video), one after the other (the
machine is shared: one run at a time). The data set and the warm-started tiny model are built once per
task under ``benchmarks/.work/seeds-<task>/`` and every run trains a fresh copy; the seed (``seed=``)
sets the data order, the sampling and the learner's randomness.

Two drivers:

* ``up`` (default): ``streamgrpo up --config <config> --set seed=<s>`` as a user runs it (2 generators and
  the learner on this machine, asynchronous: staleness 1-2), capped at ``--cap-s`` seconds or
  ``--steps`` optimizer steps;
* ``lockstep``: the in-process, on-policy driver (:mod:`benchmarks.lockstep`): deterministic per seed,
  one core, no start-up of servers (for diagnosis: a change's effect without the timing noise of ``up``).

A run stops ``--stop-after`` steps (50) after it reached 0.9 (the rest would only confirm it).
With ``--ablation`` (needle), each run's last checkpoint answers the held-out videos greedily, and the same
videos with the flash's frames cut out (``test_cut.jsonl``): ``held_out`` and ``cut`` in its row.

Printed per run: the step at which the run left chance (``steps_to_0.5``: the 50-group accuracy at 0.5, the
motion demo's order-blind ceiling), the step and seconds (from the end of the first optimizer step) at which the mean
accuracy of the last 50 trained groups first reaches 0.9, and the final accuracy; per task, how many
seeds reached 0.9 and the median steps and seconds of those that did. Figures:
``seeds_<task>_reached`` (seeds at 0.9, against the number of seeds), ``seeds_<task>_median_steps`` and
``seeds_<task>_median_s``; the per-seed rows are in the result's ``data``
(``benchmarks/results/bench_seeds.json``).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_seeds [--tasks motion,needle] [--seeds 0-9] \\
        [--driver up|lockstep] [--steps 600] [--cap-s 600] [--set learner.learning_rate=2e-3 ...]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_motion import probe_accuracy
from benchmarks.common import ROOT, emit, figure, machine_info, module_argv, write_result
from benchmarks.loop_runs import (
    WORK,
    bench_env,
    final_accuracy,
    fresh_run_dir,
    prepare_assets,
    read_jsonl,
    run_parallel,
    steps_to_target,
    stop_by_pid,
    time_to_target,
)

TASKS = {"motion": "demo-motion", "needle": "demo-needle"}
"""Task name -> shipped config."""


def parse_seeds(text: str) -> list[int]:
    """``"0-9"``, ``"0,3,5"`` or ``"0-2,7"`` -> the seeds, in order (pure)."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        if sep and (not lo or int(hi) < int(lo)):
            raise ValueError(f"--seeds: {part!r} is no range of seeds (want e.g. 0-9)")
        seeds += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds: want distinct seeds >= 0 like 0-9 or 0,3,5 (got {text!r})")
    return seeds


def run_stats(rows: list[dict[str, Any]], wall_s: float | None = None) -> dict[str, Any]:
    """One run's numbers from its ``metrics.jsonl`` rows (pure)."""
    t = time_to_target(rows)
    return {"steps": int(rows[-1]["step"]) if rows else 0, "steps_to_0.5": steps_to_target(rows, target=0.5),
            "steps_to_0.9": steps_to_target(rows),
            "seconds_to_0.9": None if t is None else round(t, 1),
            "final_accuracy": None if not rows else round(final_accuracy(rows), 3),
            "wall_s": None if wall_s is None else round(wall_s, 1)}


def task_summary(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """How many seeds reached 0.9, and the median steps and seconds of those that did (pure)."""
    hit = [r for r in runs.values() if r.get("steps_to_0.9") is not None]
    return {"seeds": len(runs), "reached": len(hit),
            "median_steps": statistics.median(r["steps_to_0.9"] for r in hit) if hit else None,
            "median_s": statistics.median(r["seconds_to_0.9"] for r in hit) if hit else None,
            "max_steps": max((r["steps_to_0.9"] for r in hit), default=None)}


def seed_figures(task: str, summary: dict[str, Any], driver: str) -> list[dict[str, Any]]:
    """The figures of one task (pure)."""
    note = f"driver {driver}; median over the seeds that reached 0.9"
    return [figure(f"seeds_{task}_reached", summary["reached"], summary["seeds"], unit="seeds",
                   note="seeds whose 50-group accuracy reached 0.9, against the seeds run"),
            figure(f"seeds_{task}_median_steps", summary["median_steps"], None, unit="steps", note=note),
            figure(f"seeds_{task}_median_s", summary["median_s"], None, unit="s", note=note)]


def needle_ablation(run_dir: Path, data_dir: Path, cap_s: float = 900.0) -> dict[str, float | None]:
    """Greedy held-out accuracy of ``run_dir``'s last checkpoint on the needle test videos and on the same
    videos with the flash's frames cut out (``test_cut.jsonl``): the drop is what the flash is worth."""
    out: dict[str, float | None] = {}
    for name, records in (("held_out", "test.jsonl"), ("cut", "test_cut.jsonl")):
        argv = [sys.executable, "-m", "streamgrpo", "eval", "--model", str(run_dir), "--data", str(data_dir / records),
                "--config", "demo-needle", "--out", str(run_dir / f"eval-{name}")]
        done = subprocess.run(argv, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=cap_s)
        if done.returncode != 0:
            print(f"# eval of {run_dir} on {records} failed (exit {done.returncode}): {done.stderr[-1500:]}", flush=True)
            out[name] = None
            continue
        result = json.loads((run_dir / f"eval-{name}" / "eval.json").read_text())
        out[name] = probe_accuracy(result, kind="needle")["ordered"]
    return out


def past_target(rows: list[dict[str, Any]], stop_after: int | None) -> bool:
    """True once the run reached 0.9 and trained ``stop_after`` steps more (pure; None: never)."""
    hit = steps_to_target(rows) if stop_after is not None and rows else None
    return hit is not None and int(rows[-1]["step"]) >= hit + stop_after


def up_until_target(run_dir: Path, *, model: Path, train: Path, config: str, sets: list[str], cap_s: float,
                    stop_after: int | None) -> tuple[list[dict[str, Any]], float]:
    """``streamgrpo up`` on a fresh copy of ``model``, stopped by PID (SIGINT: it stops its children, the learner
    saves its last checkpoint) at ``cap_s`` seconds or ``stop_after`` steps past 0.9; its rows and wall time."""
    model_copy = fresh_run_dir(run_dir, model)
    argv = [sys.executable, "-m", "streamgrpo", "up", "--config", config, "--run-dir", str(run_dir), "--generators", "2"]
    for s in [f"model.name_or_path={model_copy}", "demo.tiny_model=false", f"data.train_path={train}",
              "demo.make_data=false", "learner.save_steps=100000", "eval.enabled=false", *sets]:
        argv += ["--set", s]
    t0 = time.time()
    with open(run_dir / "up.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=bench_env(), cwd=ROOT)
        try:
            while proc.poll() is None:
                time.sleep(5)
                if time.time() - t0 > cap_s or past_target(read_jsonl(run_dir / "metrics.jsonl"), stop_after):
                    stop_by_pid(proc)
        except BaseException:
            stop_by_pid(proc)
            raise
    return read_jsonl(run_dir / "metrics.jsonl"), time.time() - t0


def one_run(task: str, seed: int, paths: dict[str, Path], args) -> dict[str, Any]:
    config = TASKS[task]
    run_dir = WORK / f"seeds-{task}" / "runs" / f"{args.driver}{args.tag}_s{seed}"
    sets = [f"seed={seed}", *args.set]
    if args.driver == "up":
        steps = [f"learner.max_steps={args.steps}"] if args.steps else []
        rows = read_jsonl(run_dir / "metrics.jsonl") if args.reuse and (run_dir / "summary.json").exists() else []
        wall = None
        if not rows:
            rows, wall = up_until_target(run_dir, model=paths["model"], train=paths["train"], config=config,
                                         sets=[*sets, *steps], cap_s=args.cap_s,
                                         stop_after=None if args.stop_after < 0 else args.stop_after)
        stats = run_stats(rows, wall)
        if task == "needle" and args.ablation:
            stats.update(needle_ablation(run_dir, paths["train"].parent))
    else:
        tail = ["--config", config, "--lag", "0", "--steps", str(args.steps or 600), "--seed", str(seed),
                "--stop-after", str(args.stop_after)]
        for s in args.set:
            tail += ["--set", s]
        argv = module_argv("lockstep", "--run-dir", str(run_dir), "--model", str(paths["model"]),
                           "--data", str(paths["train"]), *tail)
        done = run_parallel([(task, run_dir, argv)], 1, args.cap_s)[task]
        stats = run_stats(done["rows"], done["wall_s"])
    print(f"# {task} seed {seed}: {json.dumps(stats)}", flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_seeds", description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="motion,needle", help=f"comma-separated, of {sorted(TASKS)}")
    ap.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    ap.add_argument("--driver", choices=("up", "lockstep"), default="up")
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps per run (up: learner.max_steps, default the config's; lockstep: 600)")
    ap.add_argument("--cap-s", type=float, default=600.0, help="wall-clock cap per run (start-up included)")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run")
    ap.add_argument("--stop-after", type=int, default=50,
                    help="stop a run this many steps after it reached 0.9 (-1: run to --steps or --cap-s)")
    ap.add_argument("--reuse", action="store_true", help="up: score a finished run (summary.json) instead of rerunning")
    ap.add_argument("--ablation", action="store_true",
                    help="needle, driver up: greedy held-out accuracy after each run, and with the flash cut out")
    ap.add_argument("--tag", default="", help="suffix of the run folders (an A/B of --set beside the baseline's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        ap.error(f"--tasks: unknown {unknown or 'none given'}; choose from {sorted(TASKS)}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        ap.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed by PID: the run in flight is stopped too
    t0 = time.time()
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    figs = []
    for task in tasks:
        paths = prepare_assets(WORK / f"seeds-{task}", config=TASKS[task])
        runs[task] = {seed: one_run(task, seed, paths, args) for seed in seeds}
        summary = task_summary(runs[task])
        print(f"# {task}: {summary['reached']}/{summary['seeds']} seeds reached 0.9; median "
              f"{summary['median_steps']} steps, {summary['median_s']} s (slowest {summary['max_steps']} steps)",
              flush=True)
        figs += [emit(f) for f in seed_figures(task, summary, args.driver)]
    write_result("bench_seeds", figs, machine_info(), vars(args),
                 {"runs": runs, "wall_s": round(time.time() - t0)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
