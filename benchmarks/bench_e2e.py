"""End to end: streamgrpo async vs streamgrpo sync vs TRL GRPOTrainer, on the CPU demo task.

The same task (the demo colour question; its PNG variant for TRL, which cannot take video), the
same warm-started tiny Qwen2.5-VL (built once under ``benchmarks/.work/``, a fresh copy per run),
the same accuracy reward, G, learning rate, optimizer, loss settings and number of optimizer steps
(so the same number of trained groups, ``--steps`` x ``learner.groups_per_step``):

* (a) ``streamgrpo up --config demo --generators 1``: async, 1 learner + 1 generator process;
* (b) ``streamgrpo up --config demo --generators 1 --sync``: the generator produces a step's groups
  only with the newest weights, so generation and training alternate (on-policy);
* (c) TRL ``GRPOTrainer`` in one process (``benchmarks.trl_run``), generation and training in turn.

Torch threads: 1 per process (``OMP_NUM_THREADS=1``): (a) and (b) run two processes (learner,
generator), (c) one. Each run is capped at ``--cap-s`` seconds of wall clock (then stopped, and
what it trained is scored).

Figures (value, baseline, ratio = value / baseline):

* ``e2e_async_vs_sync_groups_per_s`` (a vs b) and ``e2e_async_vs_trl_groups_per_s`` (a vs c):
  steady-state trained groups/s (from the end of the first optimizer step to the end of the last);
* ``e2e_sync_vs_trl_groups_per_s`` (b vs c);
* ``e2e_async_vs_sync_time_to_0.9_s`` / ``e2e_async_vs_trl_time_to_0.9_s``: seconds from the end of
  the first step until the mean accuracy of the last 50 trained groups reaches 0.9 (start-up
  excluded; ``-`` when not reached);
* ``e2e_async_vs_sync_final_accuracy`` / ``e2e_async_vs_trl_final_accuracy``: mean accuracy of the
  last 50 trained groups;
* ``e2e_overlap_speedup``: a/b against the ideal overlap bound (G+T)/max(G,T), with G the
  generator's busy time per group (generator audit) and T the learner's step time per group
  (``seconds`` in metrics.jsonl), both measured in the sync run where they do not overlap; ratio =
  the fraction of the bound reached.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_e2e.json`` with machine info.

The default (``BENCH_STEPS`` = 100 steps, 800 groups per run; what ``make bench`` runs) takes about
10 minutes on 2 cores; the demo's 50-group mean accuracy reached 0.9 after 60-80 steps here.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_e2e [--steps 100] [--cap-s 600] [--skip trl]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit, figure, machine_info, module_argv, safe_ratio, write_result
from benchmarks.loop_runs import (
    BENCH_STEPS,
    WORK,
    fresh_run_dir,
    overlap_bound,
    prepare_assets,
    read_jsonl,
    run_capped,
    run_up,
    summarise_rows,
)

RUNS = ("async", "sync", "trl")


def run_trl(run_dir: Path, model: Path, data: Path, steps: int, cap_s: float, threads: int) -> dict[str, Any]:
    """``python -m benchmarks.trl_run`` in a subprocess, capped; returns its stats (rows scored like ours)."""
    model_copy = fresh_run_dir(run_dir, model)
    argv = module_argv("trl_run", "--run-dir", str(run_dir), "--model", str(model_copy), "--data", str(data),
                       "--steps", str(steps), "--threads", str(threads))
    t0 = time.time()
    returncode, capped = run_capped(argv, run_dir / "trl.log", cap_s, threads=threads, grace_s=10.0)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        tail = (run_dir / "trl.log").read_text(errors="replace")[-2000:]
        print(f"# trl: no training steps recorded (exit {returncode}); trl.log ends:\n{tail}", flush=True)
    stats = summarise_rows(rows)
    # a TRL step generates and then trains: its time per group is both (not comparable with T)
    stats["step_s_per_group"] = stats.pop("train_s_per_group")
    stats.update({"wall_s": time.time() - t0, "capped": capped, "returncode": returncode,
                  "gen_s_per_group": None})
    return stats


def e2e_figures(stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures from the per-run stats (pure; missing runs give None values)."""
    a, b, c = (stats.get(k) or {} for k in RUNS)
    figs = []
    for other, o in (("sync", b), ("trl", c)):
        figs.append(figure(f"e2e_async_vs_{other}_groups_per_s", a.get("groups_per_s"), o.get("groups_per_s"),
                           unit="groups/s"))
    figs.append(figure("e2e_sync_vs_trl_groups_per_s", b.get("groups_per_s"), c.get("groups_per_s"),
                       unit="groups/s"))
    for other, o in (("sync", b), ("trl", c)):
        figs.append(figure(f"e2e_async_vs_{other}_time_to_0.9_s", a.get("time_to_target_s"),
                           o.get("time_to_target_s"), unit="s", note="lower is better; - = not reached"))
    for other, o in (("sync", b), ("trl", c)):
        figs.append(figure(f"e2e_async_vs_{other}_final_accuracy", a.get("final_accuracy"),
                           o.get("final_accuracy"), unit="acc"))
    speedup = safe_ratio(a.get("groups_per_s"), b.get("groups_per_s"))
    bound = overlap_bound(b.get("gen_s_per_group"), b.get("train_s_per_group"))
    gain = None
    if speedup is not None and bound is not None and bound > 1.0:
        gain = (speedup - 1.0) / (bound - 1.0)
    figs.append(figure("e2e_overlap_speedup", speedup, bound, unit="x",
                       note=(f"a/b vs (G+T)/max(G,T), G={_s(b.get('gen_s_per_group'))} s/group, "
                             f"T={_s(b.get('train_s_per_group'))} s/group (sync run); "
                             f"fraction of the possible gain (a/b-1)/(bound-1) = {_s(gain)}")))
    return figs


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=BENCH_STEPS,
                    help="optimizer steps per run (x groups_per_step = groups)")
    ap.add_argument("--cap-s", type=float, default=600.0, help="wall-clock cap per run (start-up included)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--skip", default="", help="comma-separated runs to skip: async,sync,trl")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(RUNS):
        ap.error(f"--skip: unknown run(s) {sorted(skip - set(RUNS))}")
    paths = prepare_assets(WORK)
    from streamgrpo.config import load_config

    cfg = load_config("demo", args.set)
    sets = [f"learner.max_steps={args.steps}", *args.set]
    stats: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        if name in skip:
            continue
        print(f"# running {name}: {args.steps} steps x {cfg.learner.groups_per_step} groups, cap {args.cap_s:.0f}s",
              flush=True)
        if name == "trl":
            s = run_trl(WORK / "e2e_trl", paths["model"], paths["train_image"], args.steps, args.cap_s, args.threads)
        else:
            run = run_up(name, WORK / f"e2e_{name}", model=paths["model"], train=paths["train"], sets=sets,
                         sync=name == "sync", generators=1, cap_s=args.cap_s, threads=args.threads)
            s = run.stats
        stats[name] = s
        print(f"#   {name}: {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()})}",
              flush=True)
    figures = [emit(f) for f in e2e_figures(stats)]
    machine = machine_info(torch_threads_per_process=args.threads,
                           processes={"async": 2, "sync": 2, "trl": 1})
    setup = {"groups_per_step": cfg.learner.groups_per_step, "G": cfg.rollout.num_generations,
             "learning_rate": cfg.learner.learning_rate, "beta": cfg.loss.beta, "loss_type": cfg.loss.loss_type,
             "max_completion_length": cfg.rollout.max_completion_length, "steps": args.steps,
             "groups": args.steps * cfg.learner.groups_per_step, "trl_input": "56x56 PNG (middle frame)",
             "streamgrpo_input": "8-frame 56x56 mp4"}
    write_result("bench_e2e", figures, machine, vars(args), {"setup": setup, "runs": stats}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
