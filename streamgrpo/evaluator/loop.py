"""The evaluator process (``streamgrpo evaluator --config F``): weight versions in, held-out results out.

It subscribes to the learner's weight versions like a generator and, every ``eval.every_versions``
versions, answers the held-out records (``data.eval_path``; greedy, or ``eval.samples`` sampled at
``eval.temperature``) with that version, scores them with the run's rewards, and writes one line per
evaluated version (and the run's last one: :func:`streamgrpo.config.roles.final_version`) to ``<run_dir>/eval.jsonl``: the version, accuracy overall and per question kind,
each reward, format compliance, completion length, and with ``eval.shuffle_frames`` the same
accuracies with each video's frames shuffled and their drop. The gauges ``streamgrpo_eval_*`` carry
the last line. The learner never waits for it: it only reads versions; one that a newer version
supersedes while the evaluator is busy, or that falls between ``every_versions``, is skipped and
counted (``streamgrpo_eval_versions_skipped_total``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from streamgrpo import metrics as M
from streamgrpo.config import Config, ConfigError
from streamgrpo.config.roles import EvaluatorConfig
from streamgrpo.data.records import load_records
from streamgrpo.engines.base import SamplingParams
from streamgrpo.evaluator.answering import load_policy, report_bad, result_rows, run_batches
from streamgrpo.evaluator.scoring import eval_rewards, shuffle_drop, summarize
from streamgrpo.metrics import start_metrics
from streamgrpo.models.lora import make_weight_applier
from streamgrpo.rewards import RewardSet
from streamgrpo.runtime import collector
from streamgrpo.runtime.jsonl import JsonlWriter
from streamgrpo.runtime.processes import StopFlag, setup_torch_threads
from streamgrpo.transport.weights.factory import subscriber_from_config
from streamgrpo.transport.weights.keys import EVALUATOR

log = logging.getLogger("streamgrpo.evaluator")


def due(version: int, last: int | None, every: int, final: int | None = None) -> bool:
    """Whether ``version`` is to be evaluated: the first one seen, then every ``every``-th past the last,
    and the run's last one (``final``: ``learner.max_steps``, the version of the last step)."""
    return last is None or version - last >= every or (final is not None and version >= final and version != last)


def eval_line(version: int, summary: dict, shuffled: dict | None) -> dict[str, Any]:
    """The ``eval.jsonl`` line of one version (pure): the summary, and with shuffled frames the shuffled
    summary and the ordered-minus-shuffled drop, overall and per kind."""

    line: dict[str, Any] = {"version": version, "time": time.time(), **summary}
    if shuffled is not None:
        line["shuffled"] = shuffled
        line["shuffle_drop"] = shuffle_drop(summary, shuffled)
    return line


def export_gauges(line: dict[str, Any]) -> None:
    """Set the ``streamgrpo_eval_*`` gauges from an ``eval.jsonl`` line."""
    M.EVAL_VERSION.set(line["version"])
    for frames, s in (("ordered", line), ("shuffled", line.get("shuffled"))):
        if not s:
            continue
        if s.get("accuracy") is not None:
            M.EVAL_ACCURACY.labels(kind="all", frames=frames).set(s["accuracy"])
        for kind, v in (s.get("by_kind") or {}).items():
            if v.get("accuracy") is not None:
                M.EVAL_ACCURACY.labels(kind=kind, frames=frames).set(v["accuracy"])
    if line.get("reward") is not None:
        M.EVAL_REWARD.labels(fn="total").set(line["reward"])
    for key, value in line.items():
        if key.startswith("reward/") and value is not None:
            M.EVAL_REWARD.labels(fn=key.split("/", 1)[1]).set(value)
    if line.get("format_compliance") is not None:
        M.EVAL_FORMAT.set(line["format_compliance"])
    if line.get("completion_tokens") is not None:
        M.EVAL_TOKENS.set(line["completion_tokens"])


def _records(cfg: Config) -> list:

    if not cfg.data.eval_path:
        raise ConfigError("the evaluator needs held-out records: set data.eval_path")
    records = load_records(cfg.data.eval_path, cfg.data)
    return records[: cfg.eval.max_records] if cfg.eval.max_records else records


def evaluate_version(policy, records, cfg: Config, sampling, rewards) -> tuple[dict, dict | None]:
    """(summary, shuffled summary or None) of the loaded policy on ``records``."""

    kinds = {str(r.id): r.kind for r in records}

    def answer(shuffle_seed: int | None) -> list[dict]:
        rows: list[dict] = []
        run_batches(policy, records, cfg.data, sampling, batch_size=cfg.eval.batch_size, desc="evaluator",
                    emit=lambda rec, group: rows.extend(result_rows(rec, group, rewards, cfg.data, has_truth=True,
                                                                     with_sample=True)),
                    on_error=report_bad, shuffle_seed=shuffle_seed)
        return rows

    def summary(rows: list[dict]) -> dict:
        think = cfg.data.think_tag if cfg.data.prompt_format == "think" else None
        return summarize(rows, samples=sampling.n, reward_names=rewards.names, think_tag=think,
                         answer_tag=cfg.data.answer_tag, kinds=kinds)

    ordered = summary(answer(None))
    shuffled = summary(answer(cfg.eval.shuffle_seed)) if cfg.eval.shuffle_frames else None
    return ordered, shuffled


def run_evaluator(cfg: Config | EvaluatorConfig, *, stop: StopFlag | None = None, max_evals: int | None = None) -> int:
    """Evaluate versions until a stop signal (or ``max_evals`` evaluations, for tests); the loop sees the
    evaluator's sections only (:class:`EvaluatorConfig`)."""
    cfg = EvaluatorConfig.of(cfg)
    stop = stop if stop is not None else StopFlag()
    run_dir = Path(cfg.run_dir)
    setup_torch_threads()
    records = _records(cfg)
    e = cfg.eval
    if e.samples > 1 and e.temperature == 0:
        raise ConfigError("eval.samples > 1 needs eval.temperature above 0 (greedy samples are identical)")
    sampling = SamplingParams(n=e.samples, temperature=e.temperature, max_tokens=e.max_tokens or
                              cfg.rollout.max_completion_length, seed=cfg.seed)
    policy = load_policy(cfg.model.name_or_path, cfg, engine=e.engine, records=records, custom_mask=cfg.custom_mask)
    apply = make_weight_applier(cfg, policy.engine)  # LoRA runs send adapters: merged into the base weights
    rewards = RewardSet(cfg.model_copy(update={"rewards": eval_rewards(cfg.rewards, e.by_kind)}))
    server = start_metrics(cfg.metrics, run_dir, "evaluator")
    out = JsonlWriter(run_dir / "eval.jsonl")
    weights = subscriber_from_config(cfg.weights, run_dir,
                                     client_key=EVALUATOR if cfg.weights.curve_keys_dir else None)
    last: int | None = None
    seen: int | None = None
    done = 0
    log.info("evaluator: %d held-out records, every %d version(s)%s", len(records), e.every_versions,
             ", ordered and shuffled frames" if e.shuffle_frames else "")
    collector.started()  # set up: cyclic garbage collection from here on (paused by python -m streamgrpo)
    try:
        while not stop and (max_evals is None or done < max_evals):
            got = weights.poll(timeout_s=1.0)
            if got is None:
                continue
            version, tensors = got
            if seen is not None and version > seen + 1:
                M.EVAL_SKIPPED.inc(version - seen - 1)  # superseded while the evaluator was busy
            seen = version
            if not due(version, last, e.every_versions, final=cfg.final_version):
                M.EVAL_SKIPPED.inc()
                weights.mark_applied()
                continue
            apply(version, tensors)
            weights.mark_applied()
            t0 = time.perf_counter()
            summary, shuffled = evaluate_version(policy, records, cfg, sampling, rewards)
            line = eval_line(version, summary, shuffled)
            line["seconds"] = round(time.perf_counter() - t0, 3)
            out.write(line)
            export_gauges(line)
            last, done = version, done + 1
            log.info("evaluator: v%d accuracy %s in %.1fs", version,
                     "-" if line.get("accuracy") is None else f"{line['accuracy']:.3f}", line["seconds"])
    finally:
        weights.close()
        out.close()
        server.close()
        policy.close()
    return 0
