"""Forced staleness: each off-policy correction of the loss against a naive loss that ignores behaviour log-probs.

For k in ``--ks`` and each correction in ``--losses``, the demo trains for a fixed number of
optimizer steps (so a fixed number of groups) on rollouts that are exactly k policy versions old
(w = exp(logp - behaviour logp), the importance weight):

* ``clipped``: ``loss.ratio_mode=behaviour``: PPO's ratio w, clipped to [1 - epsilon, 1 + epsilon_high];
* ``tis``: ``clipped`` times the truncated weight min(w, 2) (``loss.tis_cap=2``);
* ``decoupled``: decoupled PPO (``loss.ratio_mode=decoupled``): clip around the learner's own
  policy, times the behaviour weight min(w, 5) (``loss.tis_cap=5``, AReaL's behaviour-weight cap);
* ``mis``: ``clipped`` with token-level masked IS (``loss.is_mask=token``: tokens whose w leaves
  [0.5, 2] add nothing): the default loss since this study;
* ``naive``: ``loss.ratio_mode=current``: the same objective with the ratio taken against the
  current policy only (value 1), i.e. plain policy gradient on stale samples.

Two drivers:

* ``lockstep`` (default): :mod:`benchmarks.lockstep`, the real sampler, rewards and learner in one
  process with an exact lag of k versions (step v trains on groups sampled by version v-1-k). One
  core per run; ``--parallel`` runs go side by side.
* ``up``: the real ``streamgrpo up --generators 1`` with ``demo.weight_apply_delay=k`` (the
  generator applies each weight version k receipts late; staleness is k plus what the queue holds,
  ~k+0.5) and ``learner.max_staleness=k+4`` (nothing dropped). Two processes per run, runs in turn.

Per (k, loss): final accuracy (mean of the last 50 trained groups), steps until the 50-group moving
mean first reaches 0.9, mean staleness. Figures per k: ``staleness_k<k>_final_accuracy`` and
``staleness_k<k>_steps_to_0.9`` (value: clipped, baseline: naive), ``staleness_k<k>_<loss>_final_accuracy``
for the other corrections (baseline: naive), and per correction ``staleness_<loss>_k<max>_vs_k0``
(final accuracy at k=8, or the largest k, against k=0: the goal is >= 0.95). A PNG plot (moving-mean
accuracy over steps per k, one panel per loss, and final accuracy against k) goes to
``benchmarks/results/staleness.png``.

Every run uses the demo config (plus ``--set`` overrides), the same warm-started model and the same
data as ``bench_e2e``. ``make bench`` runs the default: k in {0, 2, 4, 8, 16}, all five losses,
``BENCH_STEPS`` steps, lockstep, 2 runs at a time (25 runs, ~25 minutes on 2 cores; ``--seeds 0,1,2``
for the README's study).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_staleness [--ks 0,2,4,8,16] [--losses clipped,naive] [--steps N] [--driver up]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, emit, figure, machine_info, module_argv, write_result
from benchmarks.loop_runs import (
    BENCH_STEPS,
    TARGET_ACCURACY,
    WINDOW_GROUPS,
    WORK,
    fresh_run_dir,
    group_accuracies,
    prepare_assets,
    run_parallel,
    run_up,
    summarise_rows,
)

# correction name -> its loss overrides (on top of the demo config)
LOSSES: dict[str, tuple[str, ...]] = {  # each spells out every option, whatever the defaults are
    "clipped": ("loss.ratio_mode=behaviour", "loss.tis_cap=null", "loss.is_mask=null"),
    "tis": ("loss.ratio_mode=behaviour", "loss.tis_cap=2.0", "loss.is_mask=null"),
    "decoupled": ("loss.ratio_mode=decoupled", "loss.tis_cap=5.0", "loss.is_mask=null"),
    "mis": ("loss.ratio_mode=behaviour", "loss.tis_cap=null", "loss.is_mask=token"),
    "naive": ("loss.ratio_mode=current", "loss.tis_cap=null", "loss.is_mask=null"),
}
DEFAULT_KS = "0,2,4,8,16"


def run_sets(k: int, loss: str, steps: int, driver: str = "lockstep", extra: Sequence[str] = ()) -> list[str]:
    """The config overrides of one (k, loss) run, on top of the demo config and ``extra`` (``--set``)."""
    sets = [*extra, f"learner.max_steps={steps}", *LOSSES[loss]]
    if driver == "up":
        sets += [f"demo.weight_apply_delay={k}", f"learner.max_staleness={k + 4}"]
    return sets


def run_key(k: int, loss: str, seed: int) -> str:
    return f"k{k}_{loss}_s{seed}"


def lockstep_jobs(keys: list[tuple[int, str, int]], steps: int, parallel: int, cap_s: float,
                  model: Path, train: Path, extra: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Run :mod:`benchmarks.lockstep` for every (k, loss, seed), ``parallel`` processes at a time (one
    torch thread each); returns ``{run_key: {"rows", "wall_s", "capped"}}``."""
    jobs = []
    for k, loss, seed in keys:
        key = run_key(k, loss, seed)
        run_dir = WORK / f"staleness_{key}"
        argv = module_argv("lockstep", "--run-dir", str(run_dir), "--model", str(fresh_run_dir(run_dir, model)),
                           "--data", str(train), "--lag", str(k), "--steps", str(steps), "--seed", str(seed))
        for s in run_sets(k, loss, steps, extra=extra):
            argv += ["--set", s]
        print(f"# queued {key}: lockstep, {steps} steps, lag {k}, seed {seed}", flush=True)
        jobs.append((key, run_dir, argv))
    return run_parallel(jobs, parallel, cap_s)


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


def aggregate(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (k, loss) over its seeds (pure): mean / min / max final accuracy, median steps to the target
    over the seeds that reached it, how many did, mean staleness, groups per run, drops summed."""
    import statistics

    by: dict[str, list[dict[str, Any]]] = {}
    for key, r in runs.items():
        by.setdefault(key.rsplit("_s", 1)[0], []).append(r)
    out = {}
    for key, rs in by.items():
        finals = [r["final_accuracy"] for r in rs if r.get("final_accuracy") is not None]
        hits = [r["steps_to_target"] for r in rs if r.get("steps_to_target") is not None]
        stale = [r["staleness_mean"] for r in rs if r.get("staleness_mean") is not None]
        dropped: dict[str, int] = {}
        for r in rs:
            for reason, n in (r.get("groups_dropped") or {}).items():
                dropped[reason] = dropped.get(reason, 0) + int(n)
        out[key] = {"seeds": len(rs), "final_accuracy": statistics.mean(finals) if finals else None,
                    "final_accuracy_min": min(finals) if finals else None,
                    "final_accuracy_max": max(finals) if finals else None,
                    "steps_to_target": statistics.median(hits) if hits else None, "reached": len(hits),
                    "staleness_mean": statistics.mean(stale) if stale else None,
                    "groups_trained": max((r.get("groups_trained") or 0) for r in rs), "groups_dropped": dropped}
    return out


def staleness_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table, one row per (k, loss): final accuracy (mean over seeds, with the range when
    there are several), steps to 0.9 (median of the seeds that got there) and how many did."""
    lines = ["| k | loss | final accuracy | steps to 0.9 | reached 0.9 | mean staleness | groups per run | dropped |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for key in sorted(results, key=lambda s: (int(s.split("_")[0][1:]), s.split("_", 1)[1])):
        r = results[key]
        k, loss = key.split("_", 1)
        fa, lo, hi = r.get("final_accuracy"), r.get("final_accuracy_min"), r.get("final_accuracy_max")
        acc = "-" if fa is None else f"{fa:.3f}" + (f" ({lo:.2f}-{hi:.2f})" if r.get("seeds", 1) > 1 else "")
        st, hit = r.get("staleness_mean"), r.get("steps_to_target")
        lines.append(f"| {k[1:]} | {loss} | {acc} | {'-' if hit is None else f'{hit:g}'} | "
                     f"{r.get('reached', 0 if hit is None else 1)}/{r.get('seeds', 1)} | "
                     f"{'-' if st is None else f'{st:.2f}'} | {r.get('groups_trained', 0)} | "
                     f"{json.dumps(r.get('groups_dropped') or {})} |")
    return "\n".join(lines)


def staleness_figures(results: dict[str, dict[str, Any]], ks: list[int], losses: list[str]) -> list[dict]:
    """The benchmark figures (pure but for printing): per k, each correction's final accuracy against
    naive (``clipped`` keeps the historical names), steps to 0.9, and per correction the final accuracy
    at k=8 (or the largest k) against k=0."""
    figures = []
    naive = lambda k: results.get(f"k{k}_naive", {})  # noqa: E731
    for k in ks:
        for loss in [x for x in losses if x != "naive"]:
            r = results.get(f"k{k}_{loss}", {})
            tag = f"k{k}" if loss == "clipped" else f"k{k}_{loss}"
            figures.append(emit(figure(f"staleness_{tag}_final_accuracy", r.get("final_accuracy"),
                                       naive(k).get("final_accuracy"), unit="acc",
                                       note=f"value: {loss} ({', '.join(LOSSES[loss])}), baseline: naive")))
            if loss == "clipped":
                figures.append(emit(figure(f"staleness_k{k}_steps_to_0.9", r.get("steps_to_target"),
                                           naive(k).get("steps_to_target"), unit="steps",
                                           note="lower is better; median over the seeds that reached 0.9; - = none did")))
    top = 8 if 8 in ks else max(ks, default=0)  # the goal: k=8 within 5% of on-policy
    if top > 0 and 0 in ks:
        for loss in losses:
            hi, lo = results.get(f"k{top}_{loss}", {}), results.get(f"k0_{loss}", {})
            figures.append(emit(figure(f"staleness_{loss}_k{top}_vs_k0", hi.get("final_accuracy"),
                                       lo.get("final_accuracy"), unit="acc",
                                       note=f"final accuracy at k={top} against on-policy; goal >= 0.95")))
    return figures


def mean_curve(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """Pointwise mean of moving-accuracy curves over the steps all of them have (pure)."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], []
    common = sorted(set.intersection(*(set(steps) for steps, _ in curves)))
    maps = [dict(zip(steps, means)) for steps, means in curves]
    return common, [sum(m[s] for m in maps) / len(maps) for s in common]


def plot(curves: dict[str, tuple[list[int], list[float]]], results: dict[str, dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({int(key.split("_")[0][1:]) for key in curves})
    n_seeds = max((r.get("seeds", 1) for r in results.values()), default=1)
    seeds_note = f", mean of {n_seeds} seeds" if n_seeds > 1 else ""
    cmap = plt.get_cmap("viridis")
    losses = [loss for loss in LOSSES if any(key.endswith(f"_{loss}") for key in curves)]
    ncols = 3
    nrows = (len(losses) + 1 + ncols - 1) // ncols
    fig, grid = plt.subplots(nrows, ncols, figsize=(15, 4.2 * nrows), squeeze=False)
    axes = list(grid.flat)
    for ax, loss in zip(axes, losses):
        for i, k in enumerate(ks):
            steps, means = curves.get(f"k{k}_{loss}", ([], []))
            if steps:
                ax.plot(steps, means, color=cmap(i / max(1, len(ks) - 1)), label=f"k={k}")
        ax.axhline(TARGET_ACCURACY, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{loss} ({', '.join(o.removeprefix('loss.') for o in LOSSES[loss])})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"accuracy, mean of last {WINDOW_GROUPS} groups{seeds_note}")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right")
    for ax in axes[len(losses) + 1:]:
        ax.axis("off")
    ax = axes[len(losses)]
    for loss, marker in zip(losses, ("o", "s", "^", "D", "v", "x")):
        xs = [k for k in ks if results.get(f"k{k}_{loss}", {}).get("final_accuracy") is not None]
        ax.plot(xs, [results[f"k{k}_{loss}"]["final_accuracy"] for k in xs], marker=marker, label=loss)
    ax.set_xlabel("forced staleness k (policy versions)")
    ax.set_ylabel(f"final accuracy (last {WINDOW_GROUPS} groups){seeds_note}")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("final accuracy vs staleness")
    fig.suptitle("streamgrpo: stale rollouts, off-policy corrections vs a naive loss (CPU demo)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_staleness", description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default=DEFAULT_KS, help="comma-separated forced staleness values k")
    ap.add_argument("--steps", type=int, default=BENCH_STEPS, help="optimizer steps per run")
    ap.add_argument("--driver", choices=("lockstep", "up"), default="lockstep")
    ap.add_argument("--parallel", type=int, default=2, help="lockstep runs at a time (one core each)")
    ap.add_argument("--cap-s", type=float, default=900.0, help="wall-clock cap per run")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of: {', '.join(LOSSES)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: each (k, loss) runs once per seed")
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
    seeds = [int(x) for x in args.seeds.split(",") if x != ""]
    paths = prepare_assets(WORK)
    keys = [(k, loss, seed) for seed in seeds for k in ks for loss in losses]
    runs: dict[str, dict[str, Any]] = {}
    run_curves: dict[str, tuple[list[int], list[float]]] = {}
    if args.driver == "lockstep":
        for key, r in lockstep_jobs(keys, args.steps, args.parallel, args.cap_s, paths["model"],
                                    paths["train"], args.set).items():
            runs[key] = {**summarise_rows(r["rows"]), "wall_s": r["wall_s"], "capped": r["capped"]}
            run_curves[key] = moving_accuracy(r["rows"])
    else:
        for k, loss, seed in keys:
            key = run_key(k, loss, seed)
            print(f"# running {key}: up, {args.steps} steps, cap {args.cap_s:.0f}s", flush=True)
            run = run_up(key, WORK / f"staleness_{key}", model=paths["model"], train=paths["train"],
                         sets=[*run_sets(k, loss, args.steps, "up", args.set), f"seed={seed}"], generators=1,
                         cap_s=args.cap_s)
            runs[key] = run.stats
            run_curves[key] = moving_accuracy(run.rows)
    results = aggregate(runs)
    curves = {key: mean_curve([c for rk, c in run_curves.items() if rk.rsplit("_s", 1)[0] == key]) for key in results}
    for key in sorted(runs):
        st = runs[key]
        fa, sm = st.get("final_accuracy"), st.get("staleness_mean")
        print(f"#   {key}: final accuracy {fa if fa is None else round(fa, 3)}, steps to 0.9 "
              f"{st.get('steps_to_target')}, staleness {sm if sm is None else round(sm, 2)}, "
              f"{st.get('groups_trained')} groups in {st['wall_s']:.0f}s{' (capped)' if st['capped'] else ''}",
              flush=True)
    figures = staleness_figures(results, ks, losses)
    table = staleness_table(results)
    print(table)
    png = plot(curves, results, Path(args.plot))
    print(f"# plot: {png}")
    write_result("bench_staleness", figures, machine_info(torch_threads_per_process=1),
                 {**vars(args), "ks": ks, "seeds": seeds},
                 {"results": results, "runs": runs, "curves": {k: {"step": s, "accuracy": m} for k, (s, m) in curves.items()},
                  "table_markdown": table, "plot": str(png)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
