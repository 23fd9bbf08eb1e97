"""``streamgrpo report RUN_DIR``: PNG plots of a run and a short ``report.md`` linking them.

Reads ``<run>/metrics.jsonl`` (one line per learner step) and, when present, the audit logs
``<run>/audit/*.jsonl`` (generators: ``{"event": "produced", "group_id", "version", "t"}``; learner:
``{"event": "trained", "version", "group_ids"}``). Writes to ``<run>/report/``:

* ``rewards.png``     -- total reward, each reward function and accuracy over steps;
* ``loss_kl.png``     -- loss, KL, clip fractions and entropy over steps;
* ``staleness.png``   -- staleness distribution (per group from the audit logs, else per step) and
  mean/max over steps;
* ``throughput.png``  -- groups per second per role (learner trained, each generator produced) and
  learner tokens per second over wall time;
* ``eval.png``        -- held-out accuracy over weight versions (``eval.jsonl`` of ``streamgrpo evaluator``),
  overall and per kind, ordered and (dashed) with shuffled frames;
* ``weight_sync.png`` -- publish-to-applied latency, from any ``weight_sync_s`` field in the
  metrics or audit lines (the live histogram is Prometheus' ``streamgrpo_weight_sync_seconds``).

Every key is optional: a plot without data is left out and ``report.md`` says what was not
recorded. Broken lines (a run killed mid-write) are skipped and counted.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamgrpo.runtime.jsonl import read_rows

log = logging.getLogger("streamgrpo.report")

SYNC_KEYS = ("weight_sync_s", "weight_sync_seconds", "sync_s")


# ------------------------------------------------------------------------------------- reading
def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """(JSON objects, number of unreadable lines) of a JSONL file."""
    return read_rows(path)


def num(x: Any) -> float | None:
    """A finite float, or None (missing, null, text, NaN)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def series(rows: Sequence[dict], key: str, sub: str | None = None) -> tuple[list[float], list[float]]:
    """(steps, values) of ``row[key]`` (or ``row[key][sub]``) over rows where it is a number."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if sub is not None:
            v = v.get(sub) if isinstance(v, dict) else None
        v = num(v)
        if v is not None:
            xs.append(num(r.get("step")) if num(r.get("step")) is not None else float(i + 1))
            ys.append(v)
    return xs, ys


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (``window`` 1 = unchanged)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def group_staleness(audit: dict[str, list[dict]]) -> list[int]:
    """Per trained group: learner version before its step minus the version that produced it."""
    produced: dict[str, int] = {}
    for role, rows in audit.items():
        if role.startswith("generator"):
            for r in rows:
                if r.get("event") == "produced" and "group_id" in r and num(r.get("version")) is not None:
                    produced[str(r["group_id"])] = int(r["version"])
    out = []
    for r in audit.get("learner", []):
        if r.get("event") == "trained" and num(r.get("version")) is not None:
            for gid in r.get("group_ids") or []:
                if str(gid) in produced:
                    out.append(int(r["version"]) - 1 - produced[str(gid)])
    return out


def rates(times: Sequence[float], counts: Sequence[float], t0: float, bins: int = 30) -> tuple[list[float], list[float]]:
    """Counts per second in equal wall-time bins: (bin centres in minutes since t0, rate)."""
    if not times:
        return [], []
    t_end = max(times)
    span = max(t_end - t0, 1e-6)
    n = max(1, min(bins, len(times) // 4))  # a few events per bin, else the rate aliases
    width = span / n
    totals = [0.0] * n
    for t, c in zip(times, counts):
        totals[min(n - 1, max(0, int((t - t0) / width)))] += c
    return [((i + 0.5) * width) / 60.0 for i in range(n)], [c / width for c in totals]


def sync_values(rows: Sequence[dict], audit: dict[str, list[dict]]) -> list[tuple[float | None, float]]:
    """(time, seconds) of every recorded weight-sync latency."""
    out = []
    for r in [*rows, *(x for v in audit.values() for x in v)]:
        for k in SYNC_KEYS:
            v = num(r.get(k))
            if v is not None:
                out.append((num(r.get("t", r.get("time"))), v))
                break
    return out


# ------------------------------------------------------------------------------------- plotting
def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def _line(ax, xs, ys, label: str, **kw) -> None:
    """Raw values thin, a moving average on top when there are many points."""
    window = max(1, len(ys) // 20)
    if window > 2:
        line = ax.plot(xs, ys, alpha=0.25, lw=0.8, **kw)[0]
        ax.plot(xs, smooth(ys, window), color=line.get_color(), lw=1.6, label=f"{label} (avg {window})")
    else:
        ax.plot(xs, ys, lw=1.4, marker="." if len(ys) < 40 else None, label=label, **kw)


def plot_rewards(rows: Sequence[dict], path: Path) -> Path | None:
    fns = sorted({k for r in rows if isinstance(r.get("rewards"), dict) for k in r["rewards"]})
    curves = [("reward (total)", series(rows, "reward"))] + [(f"reward/{f}", series(rows, "rewards", f)) for f in fns]
    acc = series(rows, "accuracy")
    if not any(c[1][1] for c in curves) and not acc[1]:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (xs, ys) in curves:
        if ys:
            _line(ax, xs, ys, label)
    if acc[1]:
        _line(ax, *acc, "accuracy", ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("mean over the step's completions")
    ax.set_title("Reward per function and accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def eval_series(lines: Sequence[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Held-out accuracy over versions from ``eval.jsonl`` lines (pure): ``all`` and each kind, ordered,
    and with shuffled frames ``<kind> (shuffled)``."""
    out: dict[str, tuple[list[float], list[float]]] = {}

    def add(label: str, version: Any, value: Any) -> None:
        v, a = num(version), num(value)
        if v is not None and a is not None:
            xs, ys = out.setdefault(label, ([], []))
            xs.append(v)
            ys.append(a)

    for line in sorted(lines, key=lambda x: num(x.get("version")) or 0.0):
        for suffix, s in (("", line), (" (shuffled)", line.get("shuffled") or {})):
            add(f"all{suffix}", line.get("version"), s.get("accuracy"))
            for kind, v in sorted((s.get("by_kind") or {}).items()):
                add(f"{kind}{suffix}", line.get("version"), (v or {}).get("accuracy"))
    return out


def plot_eval(lines: Sequence[dict], path: Path) -> Path | None:
    curves = eval_series(lines)
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours: dict[str, Any] = {}
    for label, (xs, ys) in curves.items():
        kind = label.removesuffix(" (shuffled)")
        shuffled = label.endswith("(shuffled)")
        line = ax.plot(xs, ys, lw=2.0 if kind == "all" else 1.2, ls="--" if shuffled else "-", marker=".",
                       color=colours.get(kind), label=label)[0]
        colours.setdefault(kind, line.get_color())
    ax.set_xlabel("weight version")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Held-out accuracy (dashed: frames shuffled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_loss_kl(rows: Sequence[dict], path: Path) -> Path | None:
    panels = [("loss", [("loss", "loss")]), ("KL to reference", [("kl", "kl")]),
              ("clipped token fraction", [("clip_frac_low", "low"), ("clip_frac_high", "high"), ("clip_frac", "total")]),
              ("entropy / grad norm", [("entropy", "entropy"), ("grad_norm", "grad norm")])]
    data = [(title, [(lab, series(rows, key)) for key, lab in keys]) for title, keys in panels]
    if not any(s[1] for _, curves in data[:2] for _, s in curves):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, (title, curves) in zip(axes.flat, data):
        shown = [(lab, s) for lab, s in curves if s[1]]
        for lab, (xs, ys) in shown:
            _line(ax, xs, ys, lab)
        if not shown:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif len(shown) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    return _save(fig, path)


def plot_staleness(rows: Sequence[dict], per_group: Sequence[int], path: Path) -> Path | None:
    mean_s, max_s = series(rows, "staleness_mean"), series(rows, "staleness_max")
    if not per_group and not mean_s[1]:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    if per_group:
        hi = max(per_group)
        a.hist(per_group, bins=[x - 0.5 for x in range(min(0, min(per_group)), hi + 2)], color="tab:blue", rwidth=0.85)
        a.set_xlabel("staleness of a trained group (steps)")
        a.set_title(f"Staleness distribution ({len(per_group)} groups)")
    else:
        a.hist(mean_s[1], bins=20, color="tab:blue")
        a.set_xlabel("mean staleness of a step (steps)")
        a.set_title(f"Staleness distribution ({len(mean_s[1])} steps)")
    a.set_ylabel("count")
    for (xs, ys), lab in ((mean_s, "mean"), (max_s, "max")):
        if ys:
            _line(b, xs, ys, lab)
    b.set_xlabel("step")
    b.set_title("Staleness over steps")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput(rows: Sequence[dict], audit: dict[str, list[dict]], path: Path) -> Path | None:
    times = [num(r.get("time")) for r in rows]
    learner = [(t, r) for t, r in zip(times, rows) if t is not None]
    gens = {role: [num(r.get("t")) for r in rs if r.get("event") == "produced" and num(r.get("t")) is not None]
            for role, rs in sorted(audit.items()) if role.startswith("generator")}
    gens = {k: v for k, v in gens.items() if v}
    all_t = [t for t, _ in learner] + [t for v in gens.values() for t in v]
    if not all_t:
        return None
    t0 = min(all_t)
    if learner:  # a step line is written at the end of its step: the run started ~one step earlier
        first = learner[0][1]
        t0 = min(t0, learner[0][0] - (num(first.get("seconds")) or 0.0) - (num(first.get("wait_seconds")) or 0.0))
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if learner:
        per_step = []
        prev = 0.0 if num(learner[0][1].get("step")) == 1 else None  # a fresh run starts at 0 groups
        for _t, r in learner:
            g = num(r.get("groups_trained"))
            per_step.append(max(0.0, g - prev) if g is not None and prev is not None else float("nan"))
            prev = g if g is not None else prev
        pairs = [(t, c) for (t, _), c in zip(learner, per_step) if not math.isnan(c)]
        if pairs:
            a.plot(*rates([t for t, _ in pairs], [c for _, c in pairs], t0), marker=".", label="learner (trained)")
        tok = [(t, num(r.get("tokens"))) for t, r in learner if num(r.get("tokens")) is not None]
        if tok:
            b.plot(*rates([t for t, _ in tok], [c for _, c in tok], t0), marker=".", label="learner (trained)")
    for role, ts in gens.items():
        a.plot(*rates(ts, [1.0] * len(ts), t0), marker=".", label=f"{role} (produced)")
    a.set_title("Groups per second, by role")
    b.set_title("Tokens per second")
    if not b.lines:
        b.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=b.transAxes, color="grey")
    for ax in (a, b):
        ax.set_xlabel("minutes since start")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_weight_sync(values: Sequence[tuple[float | None, float]], path: Path) -> Path | None:
    if not values:
        return None
    secs = [v for _, v in values]
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist(secs, bins=min(30, max(5, len(secs) // 3)), color="tab:green")
    a.set_xlabel("seconds from publish to applied")
    a.set_ylabel("count")
    a.set_title(f"Weight-sync latency ({len(secs)} updates)")
    timed = [(t, v) for t, v in values if t is not None]
    if timed:
        t0 = min(t for t, _ in timed)
        b.plot([(t - t0) / 60 for t, _ in timed], [v for _, v in timed], ".", ms=4)
        b.set_xlabel("minutes since first update")
    else:
        b.plot(range(len(secs)), secs, ".", ms=4)
        b.set_xlabel("update")
    b.set_ylabel("seconds")
    b.set_title("Latency over time")
    b.grid(alpha=0.3)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------- shell
def _mean_of(rows: Sequence[dict], key: str, part: slice) -> float | None:
    vals = [v for v in (num(r.get(key)) for r in rows[part]) if v is not None]
    return sum(vals) / len(vals) if vals else None


def summary_lines(rows: Sequence[dict], per_group: Sequence[int]) -> list[str]:
    """Headline numbers: steps, wall time, first/last reward and accuracy (10-step means), drops."""
    times = [t for t in (num(r.get("time")) for r in rows) if t is not None]
    last = rows[-1] if rows else {}
    k = max(1, min(10, len(rows) // 2 or 1))
    out = [f"- steps: {int(num(last.get('step')) or len(rows))} ({len(rows)} metric lines)"]
    if len(times) > 1:
        out.append(f"- wall time between first and last step: {(max(times) - min(times)) / 60:.1f} min")
    for key in ("reward", "accuracy"):
        a, b = _mean_of(rows, key, slice(0, k)), _mean_of(rows, key, slice(-k, None))
        if a is not None and b is not None:
            out.append(f"- {key}: {a:.3f} (first {k} steps) -> {b:.3f} (last {k} steps)")
    if num(last.get("groups_trained")) is not None:
        out.append(f"- groups trained: {int(last['groups_trained'])}")
    if isinstance(last.get("groups_dropped"), dict) and last["groups_dropped"]:
        out.append("- groups dropped: " + ", ".join(f"{k}={v}" for k, v in sorted(last["groups_dropped"].items())))
    if per_group:
        out.append(f"- staleness: mean {sum(per_group) / len(per_group):.2f}, max {max(per_group)} steps")
    return out


PLOTS = (
    ("rewards.png", "Reward per function and accuracy over steps"),
    ("loss_kl.png", "Loss and KL (with clip fractions and entropy)"),
    ("staleness.png", "Staleness distribution"),
    ("throughput.png", "Throughput per role"),
    ("weight_sync.png", "Weight-sync latency"),
    ("eval.png", "Held-out accuracy over weight versions"),
)
MISSING = {
    "rewards.png": "no `reward`/`rewards`/`accuracy` values in metrics.jsonl",
    "loss_kl.png": "no `loss`/`kl` values in metrics.jsonl",
    "staleness.png": "no staleness values in metrics.jsonl and no audit logs",
    "throughput.png": "no `time` values in metrics.jsonl and no generator audit logs",
    "weight_sync.png": "not recorded in this run's files (no `weight_sync_s` field in metrics.jsonl or audit/*.jsonl); "
                       "the live histogram is Prometheus' `streamgrpo_weight_sync_seconds`",
    "eval.png": "no eval.jsonl in the run directory (`streamgrpo evaluator` did not run)",
}


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and ``report.md``; return the report path. Raises FileNotFoundError without metrics."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics.jsonl (is {run} a streamgrpo run directory?)")
    if not run.is_dir():
        run = metrics.parent
    out = Path(out_dir) if out_dir else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows, bad = read_jsonl(metrics)
    rows.sort(key=lambda r: (num(r.get("step")) is None, num(r.get("step")) or 0.0))
    audit: dict[str, list[dict]] = {}
    for p in sorted((run / "audit").glob("*.jsonl")) if (run / "audit").is_dir() else []:
        audit[p.stem], n_bad = read_jsonl(p)
        bad += n_bad
    per_group = group_staleness(audit)
    made = {
        "rewards.png": plot_rewards(rows, out / "rewards.png"),
        "loss_kl.png": plot_loss_kl(rows, out / "loss_kl.png"),
        "staleness.png": plot_staleness(rows, per_group, out / "staleness.png"),
        "throughput.png": plot_throughput(rows, audit, out / "throughput.png"),
        "weight_sync.png": plot_weight_sync(sync_values(rows, audit), out / "weight_sync.png"),
        "eval.png": plot_eval(read_jsonl(run / "eval.jsonl")[0] if (run / "eval.jsonl").is_file() else [],
                              out / "eval.png"),
    }
    md = [f"# Run report: `{run}`", "", *summary_lines(rows, per_group)]
    if bad:
        md.append(f"- {bad} unreadable line(s) skipped")
    md.append("")
    for name, title in PLOTS:
        md.append(f"## {title}")
        md.append("")
        if made[name] is not None:
            md.append(f"![{title}]({name})")
        else:
            stale = out / name
            if stale.exists():  # from an earlier report of a run that had this data
                stale.unlink()
            md.append(f"*Not plotted: {MISSING[name]}.*")
        md.append("")
    report = out / "report.md"
    report.write_text("\n".join(md))
    return report


def run_report(run_dir: str) -> int:
    """``streamgrpo report RUN_DIR``; returns the exit code."""
    try:
        report = build_report(run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in sorted(report.parent.glob("*.png")):
        print(f"  {p}")
    print(f"  {report}")
    return 0


def main(args) -> int:
    return run_report(args.run_dir)
