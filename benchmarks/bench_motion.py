"""The motion demo: time to 0.9 direction accuracy, and whether the trained model uses frame order.

Runs ``streamgrpo up --config demo-motion`` (2 generators and the learner on this machine; the data
set and the direction-warmed tiny model are built once under ``benchmarks/.work/motion/``, every run
trains a fresh copy), then ``streamgrpo eval --shuffle-frames`` of the last checkpoint on the
held-out direction records: the same records with each clip's frames in order and shuffled.

Figures (value, baseline, ratio = value / baseline):

* ``motion_time_to_0.9_s``: seconds from the start of training until the mean accuracy of the last
  50 trained groups reaches 0.9 (``time_to_target_s`` of ``summary.json``), against the 300 s budget
  the demo promises (ratio < 1 = within budget; ``-`` = not reached);
* ``motion_final_accuracy``: mean accuracy of the last 50 trained groups, against the order-blind
  ceiling 0.5 (a left clip is a right clip played backwards);
* ``motion_ordered_vs_shuffled_accuracy``: greedy held-out direction accuracy on ordered frames
  against the same records on shuffled frames (a model that uses the order loses on shuffled frames);
* with ``--tgrpo``, the same run again with ``rollout.temporal_contrast`` (Video-R1's defaults) and
  ``motion_tgrpo_vs_plain_time_to_0.9_s`` / ``_final_accuracy``.

``--seeds 0,1,2`` repeats every run per seed and reports the means (the per-seed numbers are in the
result's ``data``).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_motion [--cap-s 420] [--seeds 0] [--tgrpo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, emit, figure, machine_info, write_result
from benchmarks.loop_runs import WORK, bench_env, prepare_assets, run_up

MOTION_WORK = WORK / "motion"
BUDGET_S = 300.0
"""The demo's promise: 0.9 direction accuracy within 5 minutes of training on 2 cores."""
ORDER_BLIND = 0.5
TGRPO = "rollout.temporal_contrast={num_generations: 4, alpha: 0.3, mu: 0.8}"


def probe(run_dir: Path, test: Path, cap_s: float = 600.0) -> dict[str, float | None]:
    """``streamgrpo eval --shuffle-frames`` of ``run_dir``'s last checkpoint: direction accuracy ordered/shuffled."""
    out = run_dir / "eval"
    argv = [sys.executable, "-m", "streamgrpo", "eval", "--model", str(run_dir), "--data", str(test),
            "--config", "demo-motion", "--shuffle-frames", "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=cap_s)
    if done.returncode != 0:
        print(f"# eval of {run_dir} failed (exit {done.returncode}): {done.stderr[-1500:]}", flush=True)
        return {"ordered": None, "shuffled": None}
    return probe_accuracy(json.loads((out / "eval.json").read_text()))


def probe_accuracy(result: dict[str, Any], kind: str = "direction") -> dict[str, float | None]:
    """Ordered and shuffled accuracy of ``kind`` from an ``eval.json`` (pure)."""
    model = result.get("model") or {}
    ordered = ((model.get("metrics") or {}).get("by_kind") or {}).get(kind) or {}
    shuffled = ((model.get("shuffled") or {}).get("by_kind") or {}).get(kind) or {}
    return {"ordered": ordered.get("accuracy"), "shuffled": shuffled.get("accuracy")}


def mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over runs; None if any run lacks it (a run that never reached 0.9 has no time)."""
    values = [r.get(key) for r in runs]
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


def motion_figures(plain: list[dict[str, Any]], tgrpo: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The figures from per-seed run stats (pure)."""
    figs = [
        figure("motion_time_to_0.9_s", mean_of(plain, "time_to_target_s"), BUDGET_S, unit="s",
               note="vs the 300 s budget; - = not reached in every seed"),
        figure("motion_final_accuracy", mean_of(plain, "final_accuracy"), ORDER_BLIND, unit="acc",
               note="last 50 trained groups vs the order-blind ceiling"),
        figure("motion_ordered_vs_shuffled_accuracy", mean_of(plain, "ordered"), mean_of(plain, "shuffled"),
               unit="acc", note="held-out direction records, greedy; baseline = the same records, frames shuffled"),
    ]
    if tgrpo:
        figs.append(figure("motion_tgrpo_vs_plain_time_to_0.9_s", mean_of(tgrpo, "time_to_target_s"),
                           mean_of(plain, "time_to_target_s"), unit="s", note="lower is better; - = not reached"))
        figs.append(figure("motion_tgrpo_vs_plain_final_accuracy", mean_of(tgrpo, "final_accuracy"),
                           mean_of(plain, "final_accuracy"), unit="acc"))
        figs.append(figure("motion_tgrpo_vs_plain_shuffled_accuracy", mean_of(tgrpo, "shuffled"),
                           mean_of(plain, "shuffled"), unit="acc", note="lower = relies more on frame order"))
    return figs


def one_run(name: str, seed: int, paths: dict[str, Path], cap_s: float, sets: list[str]) -> dict[str, Any]:
    run_dir = MOTION_WORK / "runs" / f"{name}_s{seed}"
    run = run_up(name, run_dir, model=paths["model"], train=paths["train"], config="demo-motion",
                 generators=2, cap_s=cap_s, sets=[f"seed={seed}", "learner.save_steps=100000", *sets])
    stats = {k: run.stats.get(k) for k in ("steps", "groups_trained", "final_accuracy", "groups_per_s",
                                           "steps_to_target", "wall_s")}
    stats["time_to_target_s"] = run.summary.get("time_to_target_s")
    stats.update(probe(run_dir, paths["train"].with_name("test.jsonl")))
    print(f"# {name} seed {seed}: {json.dumps(stats)}", flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_motion", description=__doc__.splitlines()[0])
    ap.add_argument("--cap-s", type=float, default=420.0, help="wall-clock cap per run (start-up included)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--tgrpo", action="store_true", help="also run with T-GRPO (rollout.temporal_contrast)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    paths = prepare_assets(MOTION_WORK, config="demo-motion")
    plain = [one_run("plain", s, paths, args.cap_s, args.set) for s in seeds]
    tgrpo = [one_run("tgrpo", s, paths, args.cap_s, [TGRPO, *args.set]) for s in seeds] if args.tgrpo else None
    figs = [emit(f) for f in motion_figures(plain, tgrpo)]
    write_result("bench_motion", figs, machine_info(), vars(args), {"plain": plain, "tgrpo": tgrpo}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
