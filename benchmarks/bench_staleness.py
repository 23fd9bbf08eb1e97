"""Forced staleness: the clipped importance-ratio loss vs a naive loss that ignores behaviour log-probs.

For k in ``--ks`` and two losses, the demo trains for a fixed number of optimizer steps (so a fixed
number of groups) on rollouts that are exactly k policy versions old:

* ``clipped``: ``loss.ratio_mode=behaviour``: ratio exp(logp - behaviour logp), clipped to
  [1 - epsilon, 1 + epsilon_high] (the default loss);
* ``naive``: ``loss.ratio_mode=current``: the same objective with the ratio taken against the
  current policy only (value 1), i.e. plain policy gradient on stale samples.

Two drivers:

* ``lockstep`` (default): :mod:`benchmarks.lockstep`, the real sampler, rewards and learner in one
  process with an exact lag of k versions (step v trains on groups sampled by version v-1-k). One
  core per run; ``--parallel`` runs go side by side.
* ``up``: the real ``streamgrpo up --generators 1`` with ``rollout.weight_apply_delay=k`` (the
  generator applies each weight version k receipts late; staleness is k plus what the queue holds,
  ~k+0.5) and ``loss.max_staleness=k+4`` (nothing dropped). Two processes per run, runs in turn.

Per (k, loss): final accuracy (mean of the last 50 trained groups), steps until the 50-group moving
mean first reaches 0.9, mean staleness. Figures per k: ``staleness_k<k>_final_accuracy`` and
``staleness_k<k>_steps_to_0.9`` (value: clipped, baseline: naive). A PNG plot (moving-mean accuracy
over steps per k, one panel per loss, and final accuracy against k) goes to
``benchmarks/results/staleness.png``.

Every run uses the demo config (plus ``--set`` overrides), the same warm-started model and the same
data as ``bench_e2e``. ``make bench`` runs the default: k in {0, 1, 2, 4, 8}, both losses,
``BENCH_STEPS`` steps, lockstep, 2 runs at a time (10 runs, ~10 minutes on 2 cores).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_staleness.py [--ks 0,1,2,4,8] [--steps N] [--driver up]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, emit, figure, machine_info, write_result  # noqa: E402
from benchmarks.loop_runs import (  # noqa: E402
    BENCH_STEPS,
    TARGET_ACCURACY,
    WINDOW_GROUPS,
    WORK,
    bench_env,
    copy_model,
    group_accuracies,
    prepare_assets,
    read_jsonl,
    run_up,
    summarise_rows,
)

LOSSES = {"clipped": "behaviour", "naive": "current"}
DEFAULT_KS = "0,1,2,4,8"


def run_sets(k: int, loss: str, steps: int, driver: str = "lockstep", extra: Sequence[str] = ()) -> list[str]:
    """The config overrides of one (k, loss) run, on top of the demo config and ``extra`` (``--set``)."""
    sets = [*extra, f"learner.max_steps={steps}", f"loss.ratio_mode={LOSSES[loss]}"]
    if driver == "up":
        sets += [f"rollout.weight_apply_delay={k}", f"loss.max_staleness={k + 4}"]
    return sets


def lockstep_jobs(keys: list[tuple[int, str]], steps: int, parallel: int, cap_s: float,
                  model: Path, train: Path, extra: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Run :mod:`benchmarks.lockstep` for every (k, loss), ``parallel`` processes at a time (one
    torch thread each); returns ``{key: {"rows", "wall_s", "capped"}}``."""
    import shutil
    import subprocess
    import time

    todo = list(keys)
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    done: dict[str, dict[str, Any]] = {}
    while todo or running:
        while todo and len(running) < parallel:
            k, loss = todo.pop(0)
            key = f"k{k}_{loss}"
            run_dir = WORK / f"staleness_{key}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            argv = [sys.executable, str(ROOT / "benchmarks" / "lockstep.py"), "--run-dir", str(run_dir),
                    "--model", str(copy_model(model, run_dir)), "--data", str(train), "--lag", str(k),
                    "--steps", str(steps)]
            for s in run_sets(k, loss, steps, extra=extra):
                argv += ["--set", s]
            log = open(run_dir / "lockstep.log", "wb")
            print(f"# running {key}: lockstep, {steps} steps, lag {k}", flush=True)
            running[key] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=bench_env(1), cwd=ROOT),
                            time.time(), run_dir)
        time.sleep(0.5)
        for key, (proc, t0, run_dir) in list(running.items()):
            capped = time.time() - t0 > cap_s
            if proc.poll() is None and not capped:
                continue
            if proc.poll() is None:
                proc.kill()  # by its own PID
                proc.wait()
            del running[key]
            rows = read_jsonl(run_dir / "metrics.jsonl")
            if proc.returncode not in (0, None) and not rows:
                tail = (run_dir / "lockstep.log").read_text(errors="replace")[-1500:]
                print(f"# {key}: failed (exit {proc.returncode}); log ends:\n{tail}", flush=True)
            done[key] = {"rows": rows, "wall_s": time.time() - t0, "capped": capped}
    return done


def moving_accuracy(rows: list[dict[str, Any]], window: int = WINDOW_GROUPS) -> tuple[list[int], list[float]]:
    """(step, moving mean of the last ``window`` groups' accuracy) at every step once ``window`` groups exist."""
    accs = group_accuracies(rows)
    steps, means = [], []
    for i in range(window - 1, len(accs)):
        if i + 1 < len(accs) and accs[i + 1][0] == accs[i][0]:
            continue  # one point per step: its last group
        steps.append(accs[i][0])
        means.append(sum(a for _, _, a in accs[i - window + 1 : i + 1]) / window)
    return steps, means


def staleness_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table: k | loss | final accuracy | steps to 0.9 | mean staleness | groups | dropped."""
    lines = ["| k | loss | final accuracy | steps to 0.9 | mean staleness | groups trained | dropped |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for key in sorted(results, key=lambda s: (int(s.split("_")[0][1:]), s.split("_", 1)[1])):
        r = results[key]
        k, loss = key.split("_", 1)
        fa = r.get("final_accuracy")
        st = r.get("staleness_mean")
        lines.append(f"| {k[1:]} | {loss} | {'-' if fa is None else f'{fa:.3f}'} | "
                     f"{r.get('steps_to_target') or '-'} | {'-' if st is None else f'{st:.2f}'} | "
                     f"{r.get('groups_trained', 0)} | {json.dumps(r.get('groups_dropped') or {})} |")
    return "\n".join(lines)


def plot(curves: dict[str, tuple[list[int], list[float]]], results: dict[str, dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({int(key.split("_")[0][1:]) for key in curves})
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, loss in zip(axes[:2], LOSSES):
        for i, k in enumerate(ks):
            steps, means = curves.get(f"k{k}_{loss}", ([], []))
            if steps:
                ax.plot(steps, means, color=cmap(i / max(1, len(ks) - 1)), label=f"k={k}")
        ax.axhline(TARGET_ACCURACY, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{loss} loss (ratio_mode={LOSSES[loss]})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"accuracy, mean of last {WINDOW_GROUPS} groups")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right")
    ax = axes[2]
    for loss, marker in zip(LOSSES, ("o", "s")):
        xs = [k for k in ks if results.get(f"k{k}_{loss}", {}).get("final_accuracy") is not None]
        ax.plot(xs, [results[f"k{k}_{loss}"]["final_accuracy"] for k in xs], marker=marker, label=loss)
    ax.set_xlabel("forced staleness k (policy versions)")
    ax.set_ylabel(f"final accuracy (last {WINDOW_GROUPS} groups)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("final accuracy vs staleness")
    fig.suptitle("streamgrpo: stale rollouts, clipped importance ratio vs naive loss (CPU demo)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default=DEFAULT_KS, help="comma-separated forced staleness values k")
    ap.add_argument("--steps", type=int, default=BENCH_STEPS, help="optimizer steps per run")
    ap.add_argument("--driver", choices=("lockstep", "up"), default="lockstep")
    ap.add_argument("--parallel", type=int, default=2, help="lockstep runs at a time (one core each)")
    ap.add_argument("--cap-s", type=float, default=900.0, help="wall-clock cap per run")
    ap.add_argument("--losses", default="clipped,naive")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--plot", default=str(RESULTS_DIR / "staleness.png"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",") if k != ""]
    losses = [s for s in args.losses.split(",") if s]
    if set(losses) - set(LOSSES):
        ap.error(f"--losses: unknown {sorted(set(losses) - set(LOSSES))}; known: {list(LOSSES)}")
    if any(k < 0 for k in ks) or args.steps < 1 or args.parallel < 1:
        ap.error("--ks must be >= 0, --steps and --parallel >= 1")
    paths = prepare_assets(WORK)
    keys = [(k, loss) for k in ks for loss in losses]
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, tuple[list[int], list[float]]] = {}
    if args.driver == "lockstep":
        for key, r in lockstep_jobs(keys, args.steps, args.parallel, args.cap_s, paths["model"],
                                    paths["train"], args.set).items():
            results[key] = {**summarise_rows(r["rows"]), "wall_s": r["wall_s"], "capped": r["capped"]}
            curves[key] = moving_accuracy(r["rows"])
    else:
        for k, loss in keys:
            key = f"k{k}_{loss}"
            print(f"# running {key}: up, {args.steps} steps, cap {args.cap_s:.0f}s", flush=True)
            run = run_up(key, WORK / f"staleness_{key}", model=paths["model"], train=paths["train"],
                         sets=run_sets(k, loss, args.steps, "up", args.set), generators=1, cap_s=args.cap_s)
            results[key] = run.stats
            curves[key] = moving_accuracy(run.rows)
    for key in sorted(results):
        st = results[key]
        fa, sm = st.get("final_accuracy"), st.get("staleness_mean")
        print(f"#   {key}: final accuracy {fa if fa is None else round(fa, 3)}, steps to 0.9 "
              f"{st.get('steps_to_target')}, staleness {sm if sm is None else round(sm, 2)}, "
              f"{st.get('groups_trained')} groups in {st['wall_s']:.0f}s{' (capped)' if st['capped'] else ''}",
              flush=True)
    figures = []
    for k in ks:
        c, n = results.get(f"k{k}_clipped", {}), results.get(f"k{k}_naive", {})
        figures.append(emit(figure(f"staleness_k{k}_final_accuracy", c.get("final_accuracy"),
                                   n.get("final_accuracy"), unit="acc", note="value: clipped IS loss, baseline: naive")))
        figures.append(emit(figure(f"staleness_k{k}_steps_to_0.9", c.get("steps_to_target"), n.get("steps_to_target"),
                                   unit="steps", note="lower is better; - = not reached in the run")))
    table = staleness_table(results)
    print(table)
    png = plot(curves, results, Path(args.plot))
    print(f"# plot: {png}")
    write_result("bench_staleness", figures, machine_info(torch_threads_per_process=1),
                 {**vars(args), "ks": ks},
                 {"runs": results, "curves": {k: {"step": s, "accuracy": m} for k, (s, m) in curves.items()},
                  "table_markdown": table, "plot": str(png)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
