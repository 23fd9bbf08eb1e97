"""wandb logging for the learner (``metrics.wandb: {project, run_name, mode}``; rank 0 only).

Per step: the seed-era keys users know (``grpo/policy_seq_log_prob``, ``grpo/kl_div``,
``grpo/format_reward``, ``grpo/accuracy_reward``, ``grpo/total_reward``, ``grpo/advantage``) and
every numeric field of the ``metrics.jsonl`` line under ``streamgrpo/``; every
``metrics.sample_every`` steps a ``samples`` table of completions (prompt id, answer, text, rewards);
and each new line the evaluator wrote to ``<run_dir>/eval.jsonl`` since the last step under ``eval/``
(``eval/accuracy``, ``eval/by_kind/<kind>/accuracy``, ``eval/shuffle_drop/accuracy``, ``eval/version``, ...)
at the learner's step (the evaluator's version is ``eval/version``): one wandb run holds both.

The mode (:func:`wandb_mode`): ``metrics.wandb.mode`` when set, else ``WANDB_MODE`` when set, else online
with a ``project`` and offline without one. Offline writes ``<run_dir>/wandb/offline-run-*`` with no network
(``wandb sync`` uploads it later); the run id is kept in ``<run_dir>/wandb-run-id`` so a resumed
learner continues the same wandb run. ``mode: disabled`` or no ``metrics.wandb`` section: nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamgrpo.runtime.jsonl import read_new_lines

log = logging.getLogger(__name__)

SEED_KEYS = ("grpo/policy_seq_log_prob", "grpo/kl_div", "grpo/format_reward", "grpo/accuracy_reward",
             "grpo/total_reward", "grpo/advantage")
MAX_SAMPLE_ROWS = 32


DEFAULT_PROJECT = "streamgrpo"


def wandb_mode(wc, environ: Mapping[str, str]) -> str:
    """The wandb mode of ``metrics.wandb`` (pure): its ``mode``; else ``WANDB_MODE`` from ``environ``;
    else ``online`` when a ``project`` is set, ``offline`` when not."""
    if wc.mode is not None:
        return wc.mode
    env = (environ.get("WANDB_MODE") or "").strip()
    if env:
        return env
    return "online" if wc.project else "offline"


def seed_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The seed-era wandb keys from one ``metrics.jsonl`` record (a reward that is not configured is left out)."""
    rewards = rec.get("rewards") or {}
    out = {
        "grpo/policy_seq_log_prob": rec.get("policy_seq_log_prob"),
        "grpo/kl_div": rec.get("kl"),
        "grpo/format_reward": rewards.get("format"),
        "grpo/accuracy_reward": rewards.get("accuracy"),
        "grpo/total_reward": rec.get("reward"),
        "grpo/advantage": rec.get("adv_mean"),
    }
    return {k: float(v) for k, v in out.items() if v is not None}


def flat_scalars(rec: dict[str, Any], prefix: str = "streamgrpo/") -> dict[str, float]:
    """Every numeric field of a record (nested dicts flattened with ``/``), under ``prefix``."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, bool) or k in ("time",):
            continue
        if isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, dict):
            out.update(flat_scalars(v, f"{prefix}{k}/"))
    return out


def sample_rows(batch: list[Any], step: int, limit: int = MAX_SAMPLE_ROWS) -> list[dict[str, Any]]:
    """Rows of the samples table from accepted groups (``.group`` is a ScoredGroup)."""
    rows = []
    for a in batch:
        g = a.group
        for c in g.completions:
            rows.append({"step": step, "prompt_id": g.prompt_id, "answer": g.answer, "completion": c.text,
                         "reward": float(c.reward), **{f"reward/{k}": float(v) for k, v in c.rewards.items()}})
            if len(rows) >= limit:
                return rows
    return rows


def eval_scalars(line: dict[str, Any]) -> dict[str, float]:
    """The wandb keys of one ``eval.jsonl`` line: its numeric fields under ``eval/``."""
    return flat_scalars(line, "eval/")


class Tracker:
    """No-op base: what the learner calls when wandb is off or on ranks other than 0."""

    def log_step(self, rec: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> None:
        return None

    def close(self) -> None:
        return None

    @staticmethod
    def from_config(cfg, run_dir: str | Path, *, enabled: bool = True) -> Tracker:
        wc = cfg.metrics.wandb
        if not enabled or wc is None or wandb_mode(wc, os.environ) == "disabled":
            return Tracker()
        return WandbTracker(cfg, Path(run_dir))


class WandbTracker(Tracker):
    def __init__(self, cfg, run_dir: Path):
        import wandb

        wc = cfg.metrics.wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self._wandb = wandb
        self._eval_path, self._eval_offset = run_dir / "eval.jsonl", 0
        mode, project = wandb_mode(wc, os.environ), wc.project or DEFAULT_PROJECT
        self.run = wandb.init(project=project, name=wc.run_name or run_dir.name, mode=mode, dir=str(run_dir),
                              id=run_id, resume="allow", config=cfg.to_dict(redact=True))  # no Redis password
        log.info("wandb: project %s, run %s (%s), files under %s", project, self.run.name, mode, run_dir / "wandb")

    def log_step(self, rec: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> None:

        data: dict[str, Any] = {**seed_scalars(rec), **flat_scalars(rec)}
        evals: list[dict[str, Any]] = []
        self._eval_offset = read_new_lines(self._eval_path, self._eval_offset, evals)
        for line in evals:  # the evaluator's lines since the last step (the last wins when several)
            data.update(eval_scalars(line))
        if samples:
            columns = sorted({k for r in samples for k in r}, key=lambda k: (k.startswith("reward/"), k))
            data["samples"] = self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in samples])
        self.run.log(data, step=int(rec["step"]))

    def close(self) -> None:
        """Finish the run and wait until wandb's service has written all of it: ``run.finish()`` alone
        returns while the service may still be writing the offline run's transaction log (seen: the
        file still a bare 7-byte header), and a learner that exits then would leave it incomplete."""
        self.run.finish()
        self._wandb.teardown()
