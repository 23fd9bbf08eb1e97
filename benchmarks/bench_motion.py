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
* with ``--compare``, the same run again without T-GRPO (``rollout.temporal_contrast: null``; the
  shipped config has it on) and ``motion_tgrpo_vs_plain_time_to_0.9_s`` / ``_final_accuracy`` /
  ``_shuffled_accuracy``.

``--seeds 0,1,2`` repeats every run per seed and reports the means (the per-seed numbers are in the
result's ``data``).

``--study 0,1,2`` is the T-GRPO study instead: per seed, one run with and one without T-GRPO on the
in-process driver (:mod:`benchmarks.lockstep`, ``--config demo-motion``, ``--study-steps`` optimizer
steps, on-policy, two runs at a time on one core each: exact and deterministic per seed, unlike
``up``), scored by steps to 0.9, final accuracy and the shuffled-group accuracy T-GRPO saw; figures
``motion_study_tgrpo_vs_plain_*``, the plot ``benchmarks/results/motion_tgrpo.png`` and
``benchmarks/results/bench_motion_study.json``. ``--reuse`` keeps finished runs.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_motion [--cap-s 420] [--seeds 0] [--compare]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_motion --study 0,1,2 [--study-steps 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, ROOT, emit, figure, machine_info, module_argv, write_result
from benchmarks.loop_runs import (
    WINDOW_GROUPS,
    WORK,
    bench_env,
    final_accuracy,
    prepare_assets,
    read_jsonl,
    run_parallel,
    run_up,
    steps_to_target,
)

MOTION_WORK = WORK / "motion"
BUDGET_S = 300.0
"""The demo's promise: 0.9 direction accuracy within 5 minutes of training on 2 cores."""
ORDER_BLIND = 0.5
TGRPO = "rollout.temporal_contrast={num_generations: 4, alpha: 0.3, mu: 0.8}"
PLAIN = "rollout.temporal_contrast=null"


def probe(run_dir: Path, test: Path, cap_s: float = 600.0, sets: list[str] = ()) -> dict[str, float | None]:
    """``streamgrpo eval --shuffle-frames`` of ``run_dir``'s last checkpoint: direction accuracy ordered/shuffled.

    ``sets``: the run's ``--set`` overrides, so the probe sees the clips as the run did (frames, pixels)."""
    out = run_dir / "eval"
    argv = [sys.executable, "-m", "streamgrpo", "eval", "--model", str(run_dir), "--data", str(test),
            "--config", "demo-motion", "--shuffle-frames", "--out", str(out), *probe_sets(sets)]
    done = subprocess.run(argv, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=cap_s)
    if done.returncode != 0:
        print(f"# eval of {run_dir} failed (exit {done.returncode}): {done.stderr[-1500:]}", flush=True)
        return {"ordered": None, "shuffled": None}
    return probe_accuracy(json.loads((out / "eval.json").read_text()))


def probe_sets(sets: list[str]) -> list[str]:
    """The ``--set`` arguments of the probe: the run's ``data.*`` overrides (pure)."""
    return [arg for s in sets if s.startswith("data.") for arg in ("--set", s)]


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


def motion_figures(tgrpo: list[dict[str, Any]], plain: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The figures from per-seed run stats of the shipped recipe (T-GRPO on) and, optionally, without it (pure)."""
    figs = [
        figure("motion_time_to_0.9_s", mean_of(tgrpo, "time_to_target_s"), BUDGET_S, unit="s",
               note="vs the 300 s budget; - = not reached in every seed"),
        figure("motion_final_accuracy", mean_of(tgrpo, "final_accuracy"), ORDER_BLIND, unit="acc",
               note="last 50 trained groups vs the order-blind ceiling"),
        figure("motion_ordered_vs_shuffled_accuracy", mean_of(tgrpo, "ordered"), mean_of(tgrpo, "shuffled"),
               unit="acc", note="held-out direction records, greedy; baseline = the same records, frames shuffled"),
    ]
    if plain:
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
                 generators=2, cap_s=cap_s, sets=[f"seed={seed}", *sets])
    stats = {k: run.stats.get(k) for k in ("steps", "groups_trained", "final_accuracy", "groups_per_s",
                                           "steps_to_target", "wall_s")}
    stats["time_to_target_s"] = run.summary.get("time_to_target_s")
    stats.update(probe(run_dir, paths["train"].with_name("test.jsonl"), sets=sets))
    print(f"# {name} seed {seed}: {json.dumps(stats)}", flush=True)
    return stats


# ----------------------------------------------------------------------------- the T-GRPO study
def study_jobs(seeds: list[int], steps: int) -> list[tuple[str, list[str]]]:
    """``(run name, lockstep argv tail)`` for plain and T-GRPO per seed (pure)."""
    jobs = []
    for seed in seeds:
        for name, sets in (("plain", ["--set", PLAIN]), ("tgrpo", ["--set", TGRPO])):
            jobs.append((f"{name}_s{seed}", ["--config", "demo-motion", "--lag", "0", "--steps", str(steps),
                                             "--seed", str(seed), *sets]))
    return jobs


def run_study(jobs: list[tuple[str, list[str]]], paths: dict[str, Path], steps: int, *, parallel: int = 2,
              reuse: bool = False, cap_s: float = 1800.0) -> dict[str, list[dict[str, Any]]]:
    """Run the lockstep jobs, ``parallel`` at a time (one torch thread each); returns their rows by name."""
    out_dir = MOTION_WORK / "study"
    rows, todo = {}, []
    for name, tail in jobs:
        run_dir = out_dir / name
        done = read_jsonl(run_dir / "metrics.jsonl") if reuse else []
        if done and int(done[-1]["step"]) >= steps:
            rows[name] = done
            continue
        print(f"# queued {name}: lockstep {' '.join(tail)}", flush=True)
        todo.append((name, run_dir, module_argv("lockstep", "--run-dir", str(run_dir), "--model", str(paths["model"]),
                                                "--data", str(paths["train"]), *tail)))
    rows.update({name: r["rows"] for name, r in run_parallel(todo, parallel, cap_s).items()})
    return rows


def study_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run numbers of the study (pure): final accuracy, steps to 0.9 and 0.5, shuffled accuracy."""
    shuffled = [r["p_shuffled"] for r in rows[-(WINDOW_GROUPS // 8 + 1):] if r.get("p_shuffled") is not None]
    return {"steps": int(rows[-1]["step"]) if rows else 0, "final_accuracy": final_accuracy(rows),
            "steps_to_0.9": steps_to_target(rows), "steps_to_0.5": steps_to_target(rows, target=0.5),
            "p_shuffled_end": statistics.fmean(shuffled) if shuffled else None}


def study_figures(stats: dict[str, dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """T-GRPO against plain GRPO, means over seeds (pure)."""
    plain = [stats.get(f"plain_s{s}", {}) for s in seeds]
    tgrpo = [stats.get(f"tgrpo_s{s}", {}) for s in seeds]
    note = f"lockstep, on-policy, mean of seeds {','.join(map(str, seeds))}"
    return [
        figure("motion_study_tgrpo_vs_plain_final_accuracy", mean_of(tgrpo, "final_accuracy"),
               mean_of(plain, "final_accuracy"), unit="acc", note=note),
        figure("motion_study_tgrpo_vs_plain_steps_to_0.9", mean_of(tgrpo, "steps_to_0.9"),
               mean_of(plain, "steps_to_0.9"), unit="steps", note="- = not reached in every seed"),
        figure("motion_study_tgrpo_vs_plain_steps_to_0.5", mean_of(tgrpo, "steps_to_0.5"),
               mean_of(plain, "steps_to_0.5"), unit="steps", note="0.5 = the order-blind ceiling; - = not reached in every seed"),
    ]


def plot_study(rows: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.bench_staleness import moving_accuracy

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in sorted(rows):
        steps, means = moving_accuracy(rows[name])
        ax.plot(steps, means, color="tab:orange" if name.startswith("tgrpo") else "tab:blue",
                ls="-" if name.endswith("_s0") else ("--" if name.endswith("_s1") else ":"), label=name)
    ax.axhline(0.9, color="grey", ls="--", lw=0.8)
    ax.axhline(ORDER_BLIND, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("optimizer step (8 groups x 8 completions)")
    ax.set_ylabel(f"direction accuracy, last {WINDOW_GROUPS} groups")
    ax.set_ylim(0, 1.02)
    ax.set_title("motion demo: plain GRPO vs T-GRPO (lockstep, on-policy)")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def study_main(args, paths: dict[str, Path]) -> int:
    seeds = [int(s) for s in args.study.split(",") if s]
    rows = run_study(study_jobs(seeds, args.study_steps), paths, args.study_steps, reuse=args.reuse)
    stats = {name: study_stats(r) for name, r in rows.items()}
    for name in sorted(stats):
        print(f"# {name}: {json.dumps(stats[name])}", flush=True)
    figs = [emit(f) for f in study_figures(stats, seeds)]
    plot = plot_study(rows, RESULTS_DIR / "motion_tgrpo.png")
    print(f"# wrote {plot}")
    write_result("bench_motion_study", figs, machine_info(), vars(args), {"runs": stats}, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_motion", description=__doc__.splitlines()[0])
    ap.add_argument("--cap-s", type=float, default=420.0, help="wall-clock cap per run (start-up included)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--compare", action="store_true", help="also run without T-GRPO (rollout.temporal_contrast: null)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--study", default="", help="seeds of the T-GRPO study (lockstep) instead of the up runs")
    ap.add_argument("--study-steps", type=int, default=400)
    ap.add_argument("--reuse", action="store_true", help="study: keep runs that already have every step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    paths = prepare_assets(MOTION_WORK, config="demo-motion")
    if args.study:
        return study_main(args, paths)
    tgrpo = [one_run("tgrpo", s, paths, args.cap_s, [TGRPO, *args.set]) for s in seeds]
    plain = [one_run("plain", s, paths, args.cap_s, [PLAIN, *args.set]) for s in seeds] if args.compare else None
    figs = [emit(f) for f in motion_figures(tgrpo, plain)]
    write_result("bench_motion", figs, machine_info(), vars(args), {"tgrpo": tgrpo, "plain": plain}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
