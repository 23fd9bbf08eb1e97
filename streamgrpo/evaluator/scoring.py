"""Scoring answered held-out records (pure): accuracy (mean@K, pass@K), each reward, format compliance,
completion length, per question kind, and the ordered-minus-shuffled drop of the temporal probe.
Shared by ``streamgrpo eval`` and the evaluator process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from streamgrpo.rewards import canonical_name
from streamgrpo.rewards.format import format_score
from streamgrpo.rewards.problem_types import VIDEO_R1

FORMAT_FAMILY = ("format", "strict_format", "soft_format", "xml_count")
CORRECT = 1.0 - 1e-9
NO_KIND = "(no kind)"  # by_kind label of records without a kind


# ------------------------------------------------------------------------------------ pure parts
def eval_rewards(rewards_cfg, by_kind: Mapping[str, str]):
    """The rewards section ``eval`` scores with: every ``accuracy`` reward's ``by_kind`` (its own, or
    Video-R1's default) updated with ``eval.by_kind`` (regression by mean relative accuracy)."""

    if not by_kind:
        return rewards_cfg
    specs = []
    for spec in rewards_cfg.functions:
        if canonical_name(spec.name) == "accuracy":
            own = spec.params.get("by_kind")
            merged = {**(VIDEO_R1 if own is None else own), **by_kind}
            spec = spec.model_copy(update={"params": {**spec.params, "by_kind": merged}})
        specs.append(spec)
    return rewards_cfg.model_copy(update={"functions": specs})


def correctness_reward(names: Sequence[str]) -> str | None:
    """The reward that says whether an answer is right: ``accuracy`` if present, else the first
    reward outside the format family, else None."""
    if "accuracy" in names:
        return "accuracy"
    return next((n for n in names if n.split("#")[0] not in FORMAT_FAMILY), None)


def format_ok(text: str, think_tag: str | None, answer_tag: str) -> bool:
    """The completion's format is fully right (the ``format`` reward's rule scores 1)."""

    return format_score(text, think_tag, answer_tag) >= CORRECT


def summarize(rows: Sequence[dict], *, samples: int, reward_names: Sequence[str], think_tag: str | None,
              answer_tag: str, kinds: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The metrics of one model from its output rows (pure; see the module docstring).

    With ``kinds`` (record id -> kind) also ``by_kind``: ``{kind: {"records", "accuracy"}}``."""
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
    if kinds is not None:
        groups: dict[str, list[dict]] = {}
        for r in rows:
            kind = kinds.get(str(r["id"]))
            groups.setdefault(NO_KIND if kind is None else str(kind), []).append(r)
        out["by_kind"] = {k: {"records": len({str(r["id"]) for r in g}),
                              "accuracy": mean([r["rewards"][key] for r in g]) if key is not None else None}
                          for k, g in sorted(groups.items())}
    return out


def metric_keys(summaries: Sequence[dict]) -> list[str]:
    """Table rows in a stable order: counts, accuracy, pass@K, reward, per-function, format, length."""
    keys: list[str] = []
    for s in summaries:
        for k in s:
            if k not in keys and k not in ("accuracy_reward", "by_kind"):
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


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else float(a - b)


def shuffle_drop(ordered: dict, shuffled: dict) -> dict[str, Any]:
    """Ordered minus shuffled accuracy, overall and per kind (``by_kind`` of both summaries)."""
    theirs = shuffled.get("by_kind") or {}
    return {"accuracy": _sub(ordered.get("accuracy"), shuffled.get("accuracy")),
            "by_kind": {k: _sub(v["accuracy"], (theirs.get(k) or {}).get("accuracy"))
                        for k, v in (ordered.get("by_kind") or {}).items()}}
