"""``streamgrpo eval``: accuracy and rewards of a model on held-out records, before/after table.

For the model ``M`` (and, with ``--baseline``, for ``B`` on the same records and settings) every
record is answered (greedy by default; ``--samples K`` samples K completions at the rollout
temperature), scored with the configured rewards (or ``--rewards a,b``), and summarised:

* ``accuracy``: mean value of the correctness reward (``accuracy`` when configured, else the first
  non-format reward) over all completions -- with K samples this is mean@K;
* ``pass@K`` (K > 1): share of records with at least one fully correct sample (value >= 1);
* ``reward`` and ``reward/<fn>``: mean weighted total and mean of each reward function;
* ``format_compliance``: share of completions whose format is fully right (the ``format`` rule
  with the data's tags: think block then answer block, or an answer block for ``no_think``);
* ``completion_tokens``: mean completion length in tokens.

Outputs in ``--out`` (default ``<model dir>/eval``, or ``./eval`` for a hub id): ``eval.json``,
``eval.md`` and the raw completions ``outputs-model.jsonl`` / ``outputs-baseline.jsonl`` (the
:mod:`streamgrpo.infer` line schema plus ``sample``), from which every number can be recomputed
with :func:`summarize`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamgrpo.config import Config, ConfigError, RewardsConfig, RewardSpec

log = logging.getLogger("streamgrpo.eval")

FORMAT_FAMILY = ("format", "strict_format", "soft_format", "xml_count")
CORRECT = 1.0 - 1e-9


# ------------------------------------------------------------------------------------ pure parts
def correctness_reward(names: Sequence[str]) -> str | None:
    """The reward that says whether an answer is right: ``accuracy`` if present, else the first
    reward outside the format family, else None."""
    if "accuracy" in names:
        return "accuracy"
    return next((n for n in names if n.split("#")[0] not in FORMAT_FAMILY), None)


def format_ok(text: str, think_tag: str | None, answer_tag: str) -> bool:
    """The completion's format is fully right (the ``format`` reward's rule scores 1)."""
    from streamgrpo.rewards.format import format_score

    return format_score(text, think_tag, answer_tag) >= CORRECT


def summarize(rows: Sequence[dict], *, samples: int, reward_names: Sequence[str], think_tag: str | None,
              answer_tag: str) -> dict[str, Any]:
    """The metrics of one model from its output rows (pure; see the module docstring)."""
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(str(r["id"]), []).append(r)
    out: dict[str, Any] = {"records": len(by_id), "completions": len(rows)}
    key = correctness_reward(reward_names)
    out["accuracy_reward"] = key

    def mean(values: list[float]) -> float | None:
        return float(sum(values) / len(values)) if values else None

    if key is not None:
        out["accuracy"] = mean([r["rewards"][key] for r in rows])
        if samples > 1:
            out[f"pass@{samples}"] = mean([float(any(r["rewards"][key] >= CORRECT for r in group))
                                           for group in by_id.values()])
    else:
        out["accuracy"] = None
    out["reward"] = mean([r["reward"] for r in rows])
    for name in reward_names:
        out[f"reward/{name}"] = mean([r["rewards"][name] for r in rows])
    out["format_compliance"] = mean([float(format_ok(r["completion"], think_tag, answer_tag)) for r in rows])
    out["completion_tokens"] = mean([float(r["completion_tokens"]) for r in rows])
    return out


def metric_keys(summaries: Sequence[dict]) -> list[str]:
    """Table rows in a stable order: counts, accuracy, pass@K, reward, per-function, format, length."""
    keys: list[str] = []
    for s in summaries:
        for k in s:
            if k not in keys and k != "accuracy_reward":
                keys.append(k)
    return keys


def difference(model: dict, baseline: dict) -> dict[str, float | None]:
    """``model - baseline`` for every numeric metric both have."""
    diff: dict[str, float | None] = {}
    for k in metric_keys([model, baseline]):
        a, b = model.get(k), baseline.get(k)
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        diff[k] = float(a - b) if ok else None
    return diff


def _fmt(key: str, value: Any, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if key in ("records", "completions"):
        return f"{int(value):+d}" if signed else str(int(value))
    if key == "completion_tokens":
        return f"{value:+.1f}" if signed else f"{value:.1f}"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def table_rows(result: dict) -> list[list[str]]:
    """Header + one row per metric: metric | model [| baseline | difference]."""
    model, baseline = result["model"]["metrics"], (result.get("baseline") or {}).get("metrics")
    header = ["metric", "model"] + (["baseline", "difference"] if baseline is not None else [])
    rows = [header]
    for k in metric_keys([model] + ([baseline] if baseline is not None else [])):
        row = [k, _fmt(k, model.get(k))]
        if baseline is not None:
            row += [_fmt(k, baseline.get(k)), _fmt(k, result["difference"].get(k), signed=True)]
        rows.append(row)
    return rows


def render_text(result: dict) -> str:
    """Aligned plain-text table for the terminal."""
    rows = table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(result: dict) -> str:
    rows = table_rows(result)
    s = result["settings"]
    md = ["# Evaluation", "",
          f"- **model:** `{result['model']['name']}`"]
    if result.get("baseline"):
        md.append(f"- **baseline:** `{result['baseline']['name']}`")
    acc = result["model"]["metrics"].get("accuracy_reward")
    md += [f"- **data:** `{s['data']}` ({s['records']} records used, {s['skipped']} skipped)",
           f"- **decoding:** {'greedy' if s['temperature'] == 0 else 'temperature ' + str(s['temperature'])}, "
           f"{s['samples']} sample(s) per record, max {s['max_new_tokens']} new tokens, prompt format "
           f"`{s['prompt_format']}`",
           f"- **rewards:** {', '.join(f'`{n}` x{w}' for n, w in s['rewards'].items())}; accuracy = mean of "
           f"`{acc}`" + (f" over {s['samples']} samples (mean@{s['samples']})" if s['samples'] > 1 else ""),
           "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    md += ["", "Raw completions: " + ", ".join(f"`{Path(p).name}`" for p in s["outputs"].values()), ""]
    return "\n".join(md)


# ------------------------------------------------------------------------------------------- shell
def reward_config(cfg: Config, names: str | None) -> RewardsConfig:
    """The config's rewards, or only the ``--rewards`` names (a configured one keeps its weight and
    params; others get weight 1)."""
    if not names:
        return cfg.rewards
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        raise ConfigError(f"--rewards {names!r}: no reward names")
    known = {s.name: s for s in cfg.rewards.functions}
    specs = [known.get(n) or RewardSpec(name=n, weight=1.0) for n in wanted]
    return cfg.rewards.model_copy(update={"functions": specs})


def default_out(model: str) -> Path:
    p = Path(model)
    return p / "eval" if p.is_dir() else Path.cwd() / "eval"


def evaluate_model(label: str, model: str, adapter: str | None, records, cfg: Config, sampling, rewards,
                   out_path: Path, batch_size: int) -> tuple[str, list[dict], list[Exception]]:
    """Answer and score every record with one model; write its rows to ``out_path`` (fresh)."""
    from streamgrpo.infer import LineSink, load_policy, report_bad, result_rows, run_batches

    policy = load_policy(model, cfg, adapter)
    rows: list[dict] = []
    bad: list[Exception] = []
    sink = LineSink(out_path, mode="w")

    def emit(record, group) -> None:
        new = result_rows(record, group, rewards, cfg.data, has_truth=True, with_sample=True)
        sink.write(new)
        rows.extend(new)

    def on_error(exc: Exception) -> None:
        bad.append(exc)
        report_bad(exc)

    try:
        run_batches(policy, records, cfg.data, sampling, batch_size=batch_size, emit=emit, on_error=on_error,
                    desc=f"eval {label}")
    finally:
        sink.close()
        name = policy.name
        policy.close()
    return name, rows, bad


def run_eval(args) -> int:
    """``streamgrpo eval``: returns the exit code; writes eval.json / eval.md and prints the table."""
    from streamgrpo.infer import (
        checkpoint_of,
        read_input_records,
        report_bad,
        resolve_config,
        sampling_from_args,
    )
    from streamgrpo.rewards import RewardSet

    if args.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {args.samples}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    model = checkpoint_of(args.model)
    baseline = checkpoint_of(args.baseline) if args.baseline else None
    cfg = resolve_config(args.config, args.overrides, model, args.format)
    cfg.rewards = reward_config(cfg, args.rewards)
    rewards = RewardSet(cfg)
    if args.temperature is None:
        args.temperature = 0.0 if args.samples == 1 else cfg.rollout.temperature
    if args.samples > 1 and args.temperature == 0:
        raise ConfigError("--samples K > 1 needs a temperature above 0 (greedy samples are identical)")
    args.top_p, args.top_k = cfg.rollout.top_p, cfg.rollout.top_k
    sampling = sampling_from_args(args, cfg, n=args.samples)

    records, errors, no_truth = read_input_records(args.data, cfg.data)
    for err in errors:
        report_bad(err)
    if no_truth:
        print(f"{len(no_truth)} record(s) without a ground truth are not evaluated", file=sys.stderr)
        records = [r for r in records if r.id not in no_truth]
    if args.limit is not None:
        records = records[: max(0, args.limit)]
    if not records:
        print(f"error: {args.data}: no records to evaluate", file=sys.stderr)
        return 2

    out_dir = Path(args.out) if args.out else default_out(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    think_tag = cfg.data.think_tag if cfg.data.prompt_format == "think" else None
    runs = [("model", model, args.adapter)] + ([("baseline", baseline, None)] if baseline else [])
    result: dict[str, Any] = {}
    outputs: dict[str, str] = {}
    skipped_ids: set[str] = set()  # records a model could not be given (media errors)
    started = time.time()
    for label, path, adapter in runs:
        out_path = out_dir / f"outputs-{label}.jsonl"
        name, rows, bad = evaluate_model(label, path, adapter, records, cfg, sampling, rewards, out_path,
                                         args.batch_size)
        skipped_ids |= {str(e.record_id) for e in bad}
        outputs[label] = str(out_path)
        result[label] = {"name": name, "path": path, "adapter": adapter,
                         "metrics": summarize(rows, samples=args.samples, reward_names=rewards.names,
                                              think_tag=think_tag, answer_tag=cfg.data.answer_tag)}
    if baseline:
        result["difference"] = difference(result["model"]["metrics"], result["baseline"]["metrics"])
    result["settings"] = {
        "data": str(args.data), "records": len(records), "skipped": len(errors) + len(skipped_ids), "samples": args.samples,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_tokens, "prompt_format": cfg.data.prompt_format,
        "rewards": rewards.weights, "seed": cfg.seed, "outputs": outputs, "seconds": round(time.time() - started, 2),
    }
    (out_dir / "eval.json").write_text(json.dumps(result, indent=1))
    (out_dir / "eval.md").write_text(render_markdown(result))
    print(render_text(result))
    print(f"\nwritten: {out_dir / 'eval.json'}, {out_dir / 'eval.md'}", file=sys.stderr)
    return 0
