"""``make bench``: run every benchmark module, then print one table of every figure.

Each script runs in its own process (``OMP_NUM_THREADS=1``), prints its
``name: value (baseline: value, ratio: x)`` lines and writes ``benchmarks/results/<name>.json``;
this script then reads every ``benchmarks/results/*.json`` and prints the table (and writes it as
Markdown to ``benchmarks/results/table.md``).

Budget (``make bench``, the default; about 50 minutes on 2 cores, setup excluded): the
microbenchmarks at reduced sizes/repeats (~3 minutes); ``bench_cluster`` on 1 MB groups only, N in
{1, 4, 16, 64} generators x M in {1, 2} learners (~1 minute; ``--full``: its own 3 sizes x 4 x 3
grid), and again with visuals by reference at 10 MB-equivalent groups (~1 minute); ``bench_delta``
(weight deltas at Qwen2.5-VL-3B's layer shapes after an AdamW step, ~2 minutes); ``bench_relay`` (H hosts
x G generators behind one relay each, against every generator on TCP, ~2 minutes); ``bench_media``
(reference vs inline: bytes, Redis memory, learner time per step; ~5 minutes); ``bench_e2e`` at its default 100 steps (800 groups per run; async, sync, TRL: ~10 minutes);
``bench_staleness`` at its default (k in {0, 2, 4, 8, 16} x five losses, 100 steps, two lockstep
runs at a time: ~25 minutes); ``bench_motion``: one ``up --config demo-motion`` run and its
shuffled-frame probe (~8 minutes). ``--full`` runs the microbenchmarks at their own defaults,
``bench_e2e`` at 200 steps, the staleness study over three seeds and the motion demo over three
seeds with and without T-GRPO (about three hours).

    .venv/bin/python -m benchmarks.run_all [--full] [--only e2e,wire] [--skip staleness] [--table-only]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    build_table,
    child_pythonpath,
    load_results,
    machine_lines,
    module_argv,
)

# name -> (module under benchmarks/, make-bench budget args, --full args, timeout seconds for the budget run)
SCRIPTS: dict[str, tuple[str, list[str], list[str], float]] = {
    "wire": ("bench_wire", ["--rounds", "5"], [], 300),
    "video": ("bench_video", ["--repeats", "2", "--long-videos", "4"], [], 600),
    "queue": ("bench_queue", ["--rounds", "3", "--seconds", "1.0"], [], 600),
    "weights": ("bench_weights", ["--mib", "256", "--subs", "1,2,4", "--transports", "tcp,ipc,shm", "--repeats", "3"], [], 900),
    "delta": ("bench_delta", ["--repeats", "3"], ["--layers", "4", "--repeats", "5"], 900),
    "relay": ("bench_relay", ["--mib", "128", "--hosts", "2,4", "--gens", "1,4", "--repeats", "3", "--direct"],
              ["--mib", "256", "--hosts", "2,4", "--gens", "1,4", "--repeats", "5", "--direct"], 900),
    "learner": ("bench_learner", ["--arch", "qwen2_5_vl", "--repeats", "3"], [], 600),
    "engine": ("bench_engine", ["--repeats", "5"], [], 300),
    "checkpoint": ("bench_checkpoint", ["--vocab", "32768", "--steps", "2", "--checkpoints", "2"], [], 1500),
    "cluster": ("bench_cluster", ["--gens", "1,4,16,64", "--learners", "1,2", "--sizes", "1", "--seconds", "2"], [], 600),
    "cluster_ref": ("bench_cluster", ["--media", "reference", "--gens", "1,4,16,64", "--learners", "1", "--sizes", "10",
                                      "--seconds", "2", "--out", "benchmarks/results/bench_cluster_ref.json"],
                    ["--media", "reference", "--sizes", "10", "--out", "benchmarks/results/bench_cluster_ref.json"], 600),
    "media": ("bench_media", ["--steps", "6", "--repeats", "3"], ["--steps", "10", "--repeats", "5"], 900),
    "e2e": ("bench_e2e", [], ["--steps", "200", "--cap-s", "1200"], 1500),
    "staleness": ("bench_staleness", [], ["--seeds", "0,1,2"], 2700),
    "motion": ("bench_motion", [], ["--seeds", "0,1,2", "--compare"], 900),
}


def plan(only: set[str], skip: set[str], full: bool) -> list[tuple[str, list[str], float]]:
    """``(name, argv, timeout_s)`` of the scripts to run, in order (pure)."""
    unknown = (only | skip) - set(SCRIPTS)
    if unknown:
        raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(SCRIPTS)}")
    out = []
    for name, (module, budget, full_args, timeout) in SCRIPTS.items():
        if (only and name not in only) or name in skip:
            continue
        args = full_args if full else budget
        out.append((name, module_argv(module, *args), timeout * (6 if full else 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the scripts' own (longer) defaults")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(SCRIPTS)}")
    ap.add_argument("--skip", default="", help="comma-separated benchmarks to skip")
    ap.add_argument("--table-only", action="store_true", help="only print the table of the existing results")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    try:
        todo = [] if args.table_only else plan(only, skip, args.full)
    except ValueError as exc:
        ap.error(str(exc))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH=child_pythonpath())
    failed: list[str] = []
    t_all = time.time()
    for name, cmd, timeout in todo:
        print(f"\n=== {name}: {' '.join([Path(cmd[0]).name, *cmd[1:]])}", flush=True)
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"=== {name}: exit {rc} after {time.time() - t0:.0f}s", flush=True)
        if rc != 0:
            failed.append(f"{name} ({rc})")
    docs = load_results(RESULTS_DIR)
    table = build_table(docs)
    print(f"\n=== all figures (benchmarks/results/*.json; ratio = value / baseline unless noted)\n{table}")
    md = RESULTS_DIR / "table.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(build_table(docs, style="markdown") + "\n\nMeasured on (CPU model from /proc/cpuinfo, date):\n\n"
                  + "\n".join(machine_lines(docs)) + "\n")
    if todo:
        print(f"\n{len(todo)} benchmark(s) in {time.time() - t_all:.0f}s; table also in {md}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
