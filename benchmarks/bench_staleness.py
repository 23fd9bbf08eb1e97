"""Forced staleness: the clipped importance-ratio loss vs a naive loss that ignores behaviour log-probs.

``streamgrpo up --config demo --generators 1`` for a fixed number of optimizer steps (so a fixed
number of trained groups) with ``rollout.weight_apply_delay=k`` (the generator applies each weight
version k versions late, so every group is at least k steps stale) and ``loss.max_staleness=k+4``
(nothing is dropped for staleness), for k in ``--ks`` and two losses:

* ``clipped``: ``loss.ratio_mode=behaviour``: ratio exp(logp - behaviour logp), clipped (the default);
* ``naive``: ``loss.ratio_mode=current``: the same objective with the ratio taken against the
  current policy only (value 1), i.e. plain policy gradient on stale samples.

Per (k, loss): final accuracy (mean of the last 50 trained groups), steps until the 50-group
moving mean reaches 0.9, mean staleness. Figures per k: ``staleness_k<k>_final_accuracy`` and
``staleness_k<k>_steps_to_0.9`` (value: clipped, baseline: naive). A PNG plot (moving-mean accuracy
over steps per k, one panel per loss, and final accuracy against k) goes to
``benchmarks/results/staleness.png``.

``--quick`` (what ``make bench`` runs, to fit its time budget): k in {0, 4}, 100 steps, 240 s cap per
run (4 runs, about 12 minutes on 2 cores). The full study: k in {0, 1, 2, 4, 8}, 150 steps (10 runs;
about 45-60 minutes on 2 busy cores). The demo's accuracy needs ~180 steps to reach 0.9 here, so
steps-to-0.9 needs ``--steps 250``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_staleness.py [--quick] [--ks 0,1,2,4,8] [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, emit, figure, machine_info, write_result  # noqa: E402
from benchmarks.loop_runs import (  # noqa: E402
    TARGET_ACCURACY,
    WINDOW_GROUPS,
    WORK,
    group_accuracies,
    prepare_assets,
    run_up,
)

LOSSES = {"clipped": "behaviour", "naive": "current"}
QUICK = {"ks": "0,4", "steps": 100, "cap_s": 240.0}
FULL = {"ks": "0,1,2,4,8", "steps": 150, "cap_s": 600.0}


def run_sets(k: int, loss: str, steps: int) -> list[str]:
    """The config overrides of one (k, loss) run."""
    return [f"learner.max_steps={steps}", f"rollout.weight_apply_delay={k}", f"loss.max_staleness={k + 4}",
            f"loss.ratio_mode={LOSSES[loss]}"]


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
    ax.set_xlabel("forced staleness k (weight_apply_delay)")
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
    ap.add_argument("--quick", action="store_true", help=f"make-bench budget: {QUICK}")
    ap.add_argument("--ks", default=None, help=f"comma-separated k values (default {FULL['ks']})")
    ap.add_argument("--steps", type=int, default=None, help=f"optimizer steps per run (default {FULL['steps']})")
    ap.add_argument("--cap-s", type=float, default=None, help=f"wall-clock cap per run (default {FULL['cap_s']})")
    ap.add_argument("--losses", default="clipped,naive")
    ap.add_argument("--plot", default=str(RESULTS_DIR / "staleness.png"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    ks = [int(k) for k in (args.ks or base["ks"]).split(",")]
    steps = args.steps or base["steps"]
    cap_s = args.cap_s or base["cap_s"]
    losses = [s for s in args.losses.split(",") if s]
    if set(losses) - set(LOSSES):
        ap.error(f"--losses: unknown {sorted(set(losses) - set(LOSSES))}; known: {list(LOSSES)}")
    paths = prepare_assets(WORK)
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for k in ks:
        for loss in losses:
            key = f"k{k}_{loss}"
            print(f"# running {key}: {steps} steps, cap {cap_s:.0f}s", flush=True)
            run = run_up(key, WORK / f"staleness_{key}", model=paths["model"], train=paths["train"],
                         sets=run_sets(k, loss, steps), generators=1, cap_s=cap_s)
            results[key] = run.stats
            curves[key] = moving_accuracy(run.rows)
            fa, st = run.stats.get("final_accuracy"), run.stats.get("staleness_mean")
            print(f"#   {key}: final accuracy {fa if fa is None else round(fa, 3)}, steps to 0.9 "
                  f"{run.stats.get('steps_to_target')}, staleness {st if st is None else round(st, 2)}, "
                  f"{run.stats.get('groups_trained')} groups in {run.stats['wall_s']:.0f}s"
                  f"{' (capped)' if run.stats['capped'] else ''}", flush=True)
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
                 {**vars(args), "ks": ks, "steps": steps, "cap_s": cap_s},
                 {"runs": results, "curves": {k: {"step": s, "accuracy": m} for k, (s, m) in curves.items()},
                  "table_markdown": table, "plot": str(png)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
