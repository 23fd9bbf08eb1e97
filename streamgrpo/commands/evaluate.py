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

Temporal-reliance probe (``--shuffle-frames``, ``--shuffle-seed N``): each model answers every
record twice with the one loaded model, once as usual and once with each video's sampled frames in
a random order (per record, from N and the record id: :func:`streamgrpo.evaluator.answering.probe_visuals`;
images unchanged). Accuracy is then also given per record ``kind``, ordered and shuffled, and the
drop (ordered - shuffled): a model that uses frame order loses accuracy on the questions that need
it (direction), one that reads single frames (colour) does not.

Records that cannot be answered (a media file not found under ``data.media_root``, an unreadable
video) are skipped and counted: one line says how many and why; when no record could be scored the
command exits 2 with one line naming the first missing file and the folder it was looked for in.
``--set data.max_frames=32`` (any ``data.*`` limit) sets what the evaluation reads, recorded in
``settings.data_limits``.

Outputs in ``--out`` (default ``<model dir>/eval``, or ``./eval`` for a hub id): ``eval.json``,
``eval.md`` and the raw completions ``outputs-model.jsonl`` / ``outputs-baseline.jsonl`` (the
:mod:`streamgrpo.commands.infer` line schema plus ``sample``; with the probe also
``outputs-model-shuffled.jsonl`` / ``outputs-baseline-shuffled.jsonl``), from which every number
can be recomputed with :func:`summarize`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from streamgrpo.commands.infer import (
    LineSink,
    checkpoint_of,
    read_input_records,
    resolve_config,
    sampling_from_args,
)
from streamgrpo.config import Config, ConfigError, RewardsConfig, RewardSpec
from streamgrpo.evaluator.answering import load_policy, report_bad, result_rows, run_batches
from streamgrpo.evaluator.scoring import difference, eval_rewards, metric_keys, shuffle_drop, summarize
from streamgrpo.rewards import RewardSet

log = logging.getLogger("streamgrpo.eval")


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


def _of_kind(summary: dict, kind: str | None, key: str = "accuracy") -> Any:
    """``summary[key]`` overall (kind None) or of one kind (``by_kind``); None where absent."""
    if kind is None:
        return summary.get(key)
    return ((summary.get("by_kind") or {}).get(kind) or {}).get(key)


def probe_rows(result: dict) -> list[list[str]] | None:
    """The ``--shuffle-frames`` table, None without it: header + one row per kind and ``overall``:
    kind | records | per model: ordered, shuffled, drop (accuracy)."""
    labels = [lb for lb in ("model", "baseline") if (result.get(lb) or {}).get("shuffled") is not None]
    if not labels:
        return None
    header = ["kind", "records"] + [f"{lb} {c}" for lb in labels for c in ("ordered", "shuffled", "drop")]
    kinds = sorted({k for lb in labels for k in (result[lb]["metrics"].get("by_kind") or {})})
    rows = [header]
    for kind in [*kinds, None]:
        row = ["overall" if kind is None else kind,
               _fmt("records", _of_kind(result[labels[0]]["metrics"], kind, "records"))]
        for lb in labels:
            run = result[lb]
            drop = run["shuffle_drop"]["accuracy"] if kind is None else run["shuffle_drop"]["by_kind"].get(kind)
            row += [_fmt("accuracy", _of_kind(run["metrics"], kind)), _fmt("accuracy", _of_kind(run["shuffled"], kind)),
                    _fmt("accuracy", drop, signed=True)]
        rows.append(row)
    return rows


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_text(result: dict) -> str:
    """Aligned plain-text table for the terminal (and the probe table after it, with ``--shuffle-frames``)."""
    text = _align(table_rows(result))
    probe = probe_rows(result)
    if probe is not None:
        text += (f"\n\nshuffled frames (seed {result['settings'].get('shuffle_seed')}): accuracy per question kind; "
                 "drop = ordered - shuffled\n" + _align(probe))
    return text


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
           "- **data limits:** " + ", ".join(f"`data.{k}` {v}" for k, v in (s.get("data_limits") or {}).items()),
           f"- **rewards:** {', '.join(f'`{n}` x{w}' for n, w in s['rewards'].items())}; accuracy = mean of "
           f"`{acc}`" + (f" over {s['samples']} samples (mean@{s['samples']})" if s['samples'] > 1 else ""),
           "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    probe = probe_rows(result)
    if probe is not None:
        md += ["", "## Temporal probe: shuffled frames", "",
               f"Every record answered again with each video's sampled frames in a random order (seed "
               f"{s.get('shuffle_seed')}, per record; images unchanged). Accuracy per question kind; drop = ordered "
               "- shuffled. A drop near 0 on a kind that needs the order (e.g. direction) means the model does not "
               "use it.", "", "| " + " | ".join(probe[0]) + " |", "|" + "---|" * len(probe[0])]
        md += ["| " + " | ".join(r) + " |" for r in probe[1:]]
    md += ["", "Raw completions: " + ", ".join(f"`{Path(p).name}`" for p in s["outputs"].values()), ""]
    return "\n".join(md)


def skip_summary(errors: list[Exception], total: int, media_root: str) -> str:
    """One line: how many of ``total`` records were skipped and why (count per reason, the first path of
    each), the media root a missing file was looked for in."""
    reasons: dict[str, list] = {}
    for err in errors:
        reason = getattr(err, "reason", None) or str(err)
        reasons.setdefault(reason, []).append(getattr(err, "path", None))
    parts = []
    for reason, paths in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        first = next((p for p in paths if p), None)
        part = f"{len(paths)} {reason}" + (f" (first: {os.path.abspath(first)})" if first else "")
        parts.append(part)
    line = f"skipped {len(errors)} of {total} record(s): " + "; ".join(parts)
    if any(getattr(e, "kind", None) == "missing_file" for e in errors):
        line += f"; media files are looked for under {media_root} (data.media_root)"
    return line


def nothing_scored(errors: list[Exception], media_root: str) -> str:
    """The one-line error of an evaluation that scored no record: the first failure, and where media
    files were looked for when it is a missing one."""
    missing = [e for e in errors if getattr(e, "kind", None) == "missing_file" and getattr(e, "record_id", None)]
    first = missing[0] if missing else (errors[0] if errors else None)
    if first is None:
        return "no record could be scored"
    if missing:
        return (f"no record could be scored ({len(errors)} skipped): {first.reason}: {os.path.abspath(first.path)} (media files are "
                f"looked for under {media_root}: data.media_root, or --set data.media_root=DIR)")
    return f"no record could be scored ({len(errors)} skipped), the first: {first}"


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


def _answer(policy, records, cfg: Config, sampling, rewards, out_path: Path, batch_size: int, desc: str,
            shuffle_seed: int | None = None) -> tuple[list[dict], list[Exception]]:
    """One pass of a loaded model over ``records``: rows written to ``out_path`` (fresh), bad records."""

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
                    desc=desc, shuffle_seed=shuffle_seed)
    finally:
        sink.close()
    return rows, bad


def evaluate_model(label: str, model: str, adapter: str | None, records, cfg: Config, sampling, rewards,
                   out_path: Path, batch_size: int, shuffled_path: Path | None = None,
                   shuffle_seed: int = 0) -> tuple[str, list[dict], list[Exception], list[dict] | None]:
    """Answer and score every record with one model; write its rows to ``out_path`` (fresh).

    With ``shuffled_path`` the same model answers again with shuffled frames (``shuffle_seed``),
    rows to ``shuffled_path``; records that failed the first pass are not tried again.
    Returns (name, rows, bad records, shuffled rows or None)."""

    policy = load_policy(model, cfg, adapter, engine=cfg.eval.engine, records=records,
                         custom_mask=cfg.learner.shared_prompt)
    shuffled = None
    try:
        rows, bad = _answer(policy, records, cfg, sampling, rewards, out_path, batch_size, f"eval {label}")
        if shuffled_path is not None:
            failed = {str(e.record_id) for e in bad}
            shuffled, _ = _answer(policy, [r for r in records if str(r.id) not in failed], cfg, sampling, rewards,
                                  shuffled_path, batch_size, f"eval {label} shuffled", shuffle_seed)
    finally:
        name = policy.name
        policy.close()
    return name, rows, bad, shuffled


def _check_eval_args(args) -> tuple[bool, int]:
    """Reject bad ``eval`` counts and seeds; returns (shuffle frames?, the shuffle seed)."""
    if args.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {args.samples}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    shuffle = bool(getattr(args, "shuffle_frames", False))
    shuffle_seed = getattr(args, "shuffle_seed", None)
    if shuffle_seed is not None and not shuffle:
        raise ConfigError("--shuffle-seed needs --shuffle-frames")
    shuffle_seed = 0 if shuffle_seed is None else int(shuffle_seed)
    if shuffle_seed < 0:
        raise ConfigError(f"--shuffle-seed must be >= 0, got {shuffle_seed}")
    return shuffle, shuffle_seed


def _eval_sampling(args, cfg: Config):
    """The sampling parameters: greedy for one sample, else the config's temperature (``args`` gets the
    resolved temperature, top_p and top_k)."""

    if args.temperature is None:
        args.temperature = 0.0 if args.samples == 1 else cfg.rollout.temperature
    if args.samples > 1 and args.temperature == 0:
        raise ConfigError("--samples K > 1 needs a temperature above 0 (greedy samples are identical)")
    args.top_p, args.top_k = cfg.rollout.top_p, cfg.rollout.top_k
    return sampling_from_args(args, cfg, n=args.samples)


def _eval_records(args, cfg: Config) -> tuple[list, list]:
    """The records to evaluate (with a ground truth, at most ``--limit``) and the unreadable ones (reported)."""

    records, errors, no_truth = read_input_records(args.data, cfg.data)
    for err in errors:
        report_bad(err)
    if no_truth:
        print(f"{len(no_truth)} record(s) without a ground truth are not evaluated", file=sys.stderr)
        records = [r for r in records if r.id not in no_truth]
    if args.limit is not None:
        records = records[: max(0, args.limit)]
    return records, errors


DATA_LIMITS = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
"""The data settings that bound what a model sees (``--set data.max_frames=32``...), in ``eval.json``."""


def missing_media(record) -> tuple[str, str] | None:
    """``(kind, path)`` of the first media file of ``record`` that is not there, else None."""
    for kind, path in record.media():
        if not Path(path).is_file():
            return kind, path
    return None


def _media_root(args, cfg: Config) -> str:
    """The folder relative media paths of ``--data`` resolve against (as :func:`read_input_records`)."""
    return str(Path(cfg.data.media_root or Path(os.path.expanduser(str(args.data))).parent).resolve())


def run_eval(args) -> int:
    """``streamgrpo eval``: returns the exit code; writes eval.json / eval.md and prints the table."""

    shuffle, shuffle_seed = _check_eval_args(args)
    model = checkpoint_of(args.model)
    baseline = checkpoint_of(args.baseline) if args.baseline else None
    cfg = resolve_config(args.config, args.overrides, model, args.format)
    cfg.rewards = eval_rewards(reward_config(cfg, args.rewards), cfg.eval.by_kind)
    rewards = RewardSet(cfg)
    sampling = _eval_sampling(args, cfg)

    records, errors = _eval_records(args, cfg)
    media_root = _media_root(args, cfg)
    if not records and not errors:
        print(f"error: {args.data}: no records to evaluate", file=sys.stderr)
        return 2
    if all(missing_media(r) for r in records):  # nothing could be scored: say so before loading a model
        from streamgrpo.data.records import DataError

        errors = errors + [DataError(r.id, path, f"{kind} file not found", kind="missing_file")
                           for r in records for kind, path in [missing_media(r)]]
        print(f"error: {args.data}: {nothing_scored(errors, media_root)}", file=sys.stderr)
        return 2

    out_dir = Path(args.out) if args.out else default_out(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    think_tag = cfg.data.think_tag if cfg.data.prompt_format == "think" else None
    runs = [("model", model, args.adapter)] + ([("baseline", baseline, None)] if baseline else [])
    result: dict[str, Any] = {}
    outputs: dict[str, str] = {}
    skipped_ids: set[str] = set()  # records a model could not be given (media errors)
    bad_errors: list[Exception] = []  # their errors, one per record
    kinds = {str(r.id): r.kind for r in records} if shuffle or any(r.kind is not None for r in records) else None

    def summary(rows: list[dict]) -> dict[str, Any]:
        return summarize(rows, samples=args.samples, reward_names=rewards.names, think_tag=think_tag,
                         answer_tag=cfg.data.answer_tag, kinds=kinds)

    started = time.time()
    for label, path, adapter in runs:
        out_path = out_dir / f"outputs-{label}.jsonl"
        shuffled_path = out_dir / f"outputs-{label}-shuffled.jsonl" if shuffle else None
        name, rows, bad, shuffled = evaluate_model(label, path, adapter, records, cfg, sampling, rewards, out_path,
                                                   args.batch_size, shuffled_path, shuffle_seed)
        if not rows:  # every record failed (unreadable media...): a table of blanks is no result
            print(f"error: {args.data}: {nothing_scored(errors + bad, media_root)}", file=sys.stderr)
            return 2
        skipped_ids |= {str(e.record_id) for e in bad}
        bad_errors += [e for e in bad if str(e.record_id) not in {str(b.record_id) for b in bad_errors}]
        outputs[label] = str(out_path)
        result[label] = {"name": name, "path": path, "adapter": adapter, "metrics": summary(rows)}
        if shuffled is not None:
            outputs[f"{label}-shuffled"] = str(shuffled_path)
            result[label]["shuffled"] = summary(shuffled)
            result[label]["shuffle_drop"] = shuffle_drop(result[label]["metrics"], result[label]["shuffled"])
    if baseline:
        result["difference"] = difference(result["model"]["metrics"], result["baseline"]["metrics"])
    result["settings"] = {
        "data": str(args.data), "records": len(records), "skipped": len(errors) + len(skipped_ids), "samples": args.samples,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_tokens, "prompt_format": cfg.data.prompt_format,
        "rewards": rewards.weights, "seed": cfg.seed, "outputs": outputs, "seconds": round(time.time() - started, 2),
    }
    result["settings"]["data_limits"] = {k: getattr(cfg.data, k) for k in DATA_LIMITS}
    if shuffle:
        result["settings"].update(shuffle_frames=True, shuffle_seed=shuffle_seed)
    (out_dir / "eval.json").write_text(json.dumps(result, indent=1))
    (out_dir / "eval.md").write_text(render_markdown(result))
    print(render_text(result))
    if errors or bad_errors:
        print(skip_summary(errors + bad_errors, len(records) + len(errors), media_root), file=sys.stderr)
    print(f"\nwritten: {out_dir / 'eval.json'}, {out_dir / 'eval.md'}", file=sys.stderr)
    return 0
