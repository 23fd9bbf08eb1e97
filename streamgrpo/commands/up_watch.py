"""Watching a ``streamgrpo up`` run and reporting it: the live status line (:class:`Watch`, following
``metrics.jsonl``, ``eval.jsonl`` and the queue depth), the wait for the evaluator's final result, and at the
end ``summary.json``, ``reward.png`` and ``eval.png`` (:func:`finish_run`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from streamgrpo.commands.report import plot_eval
from streamgrpo.commands.up_children import Child
from streamgrpo.config import Config
from streamgrpo.config.roles import final_version
from streamgrpo.runtime.accuracy import TARGET_ACCURACY, WINDOW_GROUPS, group_accuracies, target_reached
from streamgrpo.runtime.jsonl import read_new_lines, write_json
from streamgrpo.transport.queue.factory import open_queue

FINAL_EVAL_WAIT_S = 300.0
"""How long `up` waits, after the learner's last step, for the evaluator's result at that version."""


def summarise(rows: list[dict[str, Any]], started: float, finished: float) -> dict[str, Any]:
    """summary.json: steps, groups, accuracy over the first/last 50 trained groups, time to 0.9."""
    accs = [a for _, _, a in group_accuracies(rows)]
    first, last = accs[:WINDOW_GROUPS], accs[-WINDOW_GROUPS:]
    hit = target_reached(rows)
    time_to_target = None if hit is None else round(hit[1] - started, 2)
    final = rows[-1] if rows else {}
    return {
        "steps": final.get("step", 0),
        "version": final.get("version", 0),
        "groups_trained": final.get("groups_trained", 0),
        "groups_dropped": final.get("groups_dropped", {}),
        "wall_seconds": round(finished - started, 2),
        "first_accuracy": sum(first) / len(first) if first else None,
        "last_accuracy": sum(last) / len(last) if last else None,
        "time_to_target_s": time_to_target,
        "target_accuracy": TARGET_ACCURACY,
        "final_reward": final.get("reward"),
    }


def best_eval(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The best held-out accuracy of ``eval.jsonl`` lines and its version (pure); None when there is none."""
    scored = [(line["accuracy"], line.get("version")) for line in lines if isinstance(line.get("accuracy"), (int, float))]
    if not scored:
        return {"best_eval_accuracy": None, "best_eval_version": None}
    acc, version = max(scored, key=lambda x: (x[0], -(x[1] or 0)))  # the earliest version reaching the best
    return {"best_eval_accuracy": acc, "best_eval_version": version}


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in rows], label="reward (total)", color="tab:blue")
    fns = sorted({k for r in rows for k in (r.get("rewards") or {})})
    for fn in fns:
        if fn != "accuracy":
            ax.plot(steps, [(r.get("rewards") or {}).get(fn) for r in rows], label=f"reward: {fn}", alpha=0.6)
    if any(r.get("accuracy") is not None for r in rows):
        ax.plot(steps, [r.get("accuracy") for r in rows], label="accuracy", color="tab:green")
    ax.axhline(TARGET_ACCURACY, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean over the step's groups")
    ax.set_ylim(-0.05, max(1.05, max((r["reward"] for r in rows), default=1.0) + 0.05))
    ax.legend(loc="lower right")
    ax.set_title("streamgrpo: reward and accuracy over training")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def status_line(rows: list[dict[str, Any]], depth: int | None, started: float, alive: str,
                 evals: list[dict[str, Any]] | None = None) -> str:
    r = rows[-1] if rows else {}
    e = evals[-1] if evals else None
    held_out = "" if e is None else (f"eval {'-' if e.get('accuracy') is None else format(e['accuracy'], '.3f')}"
                                     f"@v{e.get('version')}  ")
    elapsed = time.time() - started
    gps = r.get("groups_trained", 0) / elapsed if elapsed > 0 else 0.0
    acc, mfu = r.get("accuracy"), r.get("mfu")
    return (f"[{elapsed:6.0f}s] step {r.get('step', 0):4d}  v{r.get('version', 0):<4d} "
            f"reward {r.get('reward', float('nan')):.3f}  acc {'-' if acc is None else f'{acc:.3f}'}  "
            f"stale {r.get('staleness_mean', 0.0):.1f}  queue {'-' if depth is None else depth:>3}  "
            f"{gps:.2f} groups/s  {r.get('tokens_per_second', 0.0):.0f} tok/s  "
            f"{held_out}{'' if mfu is None else f'MFU {100 * mfu:.1f}%  '}{alive}")


class Watch:
    """The live status line: follows ``metrics.jsonl`` and the queue depth until the learner ends."""

    def __init__(self, cfg: Config, env: dict[str, str], metrics_path: Path):
        self.cfg, self.env, self.metrics_path = cfg, env, metrics_path
        self.eval_path = metrics_path.with_name("eval.jsonl")
        self.ranks = cfg.launch.learner_ranks
        self.rows: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.offset = self.eval_offset = 0
        self.queue = None
        self.started = time.time()
        self.finished: float | None = None

    def read(self) -> None:
        self.offset = read_new_lines(self.metrics_path, self.offset, self.rows)
        self.eval_offset = read_new_lines(self.eval_path, self.eval_offset, self.evals)

    def until_done(self, children: list[Child], status_every_s: float) -> int:
        """Show the status until the learner exits (its code) or every generator has (0); an evaluator
        that exits is reported and training goes on."""
        learner, others = children[0], children[1:]
        gens = [c for c in others if c.name != "evaluator"]
        tty, last_print, reported = sys.stdout.isatty(), 0.0, set()
        while True:
            self.read()
            if self.queue is None:
                self.queue = try_queue(self.cfg, self.env)
            alive = sum(c.alive() for c in gens)
            line = status_line(self.rows, queue_depth(self.queue), self.started,
                                f"{self.ranks} learner ranks, gens {alive}/{len(gens)}" if self.ranks > 1
                                else f"gens {alive}/{len(gens)}", self.evals)
            if tty:
                sys.stdout.write("\r" + line[: os.get_terminal_size().columns - 1])
                sys.stdout.flush()
            elif time.time() - last_print >= 10.0:
                print(line, flush=True)
                last_print = time.time()
            for c in others:
                if not c.alive() and c.name not in reported:
                    reported.add(c.name)
                    print(f"\n{c.name} exited with code {c.proc.returncode}; see {c.log_path}", flush=True)
            if not learner.alive():
                code = learner.proc.returncode or 0
                if code != 0:
                    print(f"\nthe learner exited with code {code}; see {learner.log_path}", flush=True)
                return code
            if alive == 0 and gens:
                print("\nall generators have exited; stopping the learner", flush=True)
                return 0
            try:  # the next status, or the learner's exit at once (its last step ends the run)
                learner.proc.wait(timeout=status_every_s)
            except subprocess.TimeoutExpired:
                pass

    def await_final_eval(self, children: list[Child], timeout_s: float = FINAL_EVAL_WAIT_S) -> None:
        """After the learner's last step: wait (at most ``timeout_s``) for the evaluator's result at the
        final version, which it evaluates whatever ``eval.every_versions`` says."""
        evaluator = next((c for c in children if c.name == "evaluator"), None)
        self.read()
        if evaluator is None or not evaluator.alive() or not self.rows:
            return

        final = final_version(self.cfg)
        if self.rows[-1].get("step", 0) < self.cfg.learner.max_steps or final <= 0:
            return  # the learner stopped early: there is no final version to wait for
        print(f"\nwaiting for the evaluator's result at v{final} (at most {timeout_s:.0f} s) ...", flush=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline and evaluator.alive():
            self.read()
            if any((e.get("version") or -1) >= final for e in self.evals):
                return
            time.sleep(0.5)
        print(f"no evaluator result at v{final}; see {evaluator.log_path}", flush=True)

    def close(self) -> None:
        self.finished = time.time()
        if self.queue is not None:
            self.queue.close()


def finish_run(rd: Path, watch: Watch, interrupted: bool) -> None:
    """summary.json, reward.png and the closing lines."""
    watch.read()
    summary = summarise(watch.rows, watch.started, watch.finished or time.time())
    summary["interrupted"] = interrupted
    if watch.evals:
        summary.update(best_eval(watch.evals))
    write_json(rd / "summary.json", summary)
    outputs = [rd / "config.yaml", watch.metrics_path, rd / "summary.json"]
    if watch.rows:
        outputs.append(plot_rewards(watch.rows, rd / "reward.png"))
    if watch.evals:
        outputs += [p for p in (watch.eval_path, plot_eval(watch.evals, rd / "eval.png")) if p is not None]
    keys = ("steps", "groups_trained", "first_accuracy", "last_accuracy", "time_to_target_s", "wall_seconds",
            *(("best_eval_accuracy", "best_eval_version") if watch.evals else ()))
    print("\n" + json.dumps({k: summary[k] for k in keys}), flush=True)
    for p in outputs:
        print(f"  {p}")


def try_queue(cfg: Config, env: dict[str, str]):
    try:
        url = cfg.queue.url or env.get("STREAMGRPO_REDIS_URL")
        return open_queue(cfg.queue, url, consumer="up-status") if url else None
    except Exception:  # noqa: BLE001 - the status line simply shows no depth
        return None


def queue_depth(queue) -> int | None:
    if queue is None:
        return None
    try:
        return queue.depth()
    except Exception:  # noqa: BLE001
        return None
