"""The weighted reward set a generator (and ``streamgrpo eval``) scores each group with.

:class:`RewardSet` is built from the ``rewards`` config section. :meth:`RewardSet.score` calls
each function once per group with ``fn(completions, answers=[answer] * G, **fields)`` where every
field of the record is broadcast to a list of G (TRL's convention: one column entry per
completion), and returns every value plus the weighted total.

Robustness: a function that raises, returns the wrong length, returns a non-finite or
non-numeric value, or runs past ``timeout_s`` gives 0 for the affected completions (all of them,
except for bad single values), logs one line naming the reward and the error, and counts
``streamgrpo_errors_total{kind="reward"}``; scoring goes on. ``None`` values are TRL's "does not
apply" and count as 0 silently.

Timeouts: each call runs in a fresh daemon thread and the caller stops waiting after
``timeout_s``. Python cannot kill a thread, so a call that really hangs is *abandoned*: it keeps
running in the background (it cannot block interpreter exit, being a daemon). At most
``MAX_ABANDONED`` abandoned calls per function are allowed to be alive; past that the function is
not called again (scored 0, logged, counted) until one of them finishes, so a hanging reward cannot
leak threads without bound. A call stuck inside C code that holds the GIL (a catastrophic regex)
stalls every thread; the built-in rewards avoid such patterns.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, RewardsConfig, RewardSpec
from ..config.roles import RoleConfig
from ..metrics import ERRORS, REWARD
from .registry import canonical_name, factory_params, get

log = logging.getLogger("streamgrpo.rewards")

MAX_ABANDONED = 4
_NEED_THINK_TAG = ("strict_format", "soft_format", "xml_count")


class RewardTimeout(TimeoutError):
    """A reward call ran past ``rewards.timeout_s``."""


@dataclass
class ScoredRewards:
    """The rewards of one group: ``totals[i]`` is the weighted sum for completion i."""

    totals: list[float]
    per_fn: dict[str, list[float]]
    errors: dict[str, str] = field(default_factory=dict)  # reward name -> error of this call

    def for_completion(self, i: int) -> dict[str, float]:
        """``{name: value}`` of completion ``i`` (the wire message's ``rewards`` field)."""
        return {name: values[i] for name, values in self.per_fn.items()}


def _accepts_var_kw(fn: Callable[..., Any]) -> tuple[bool, set[str]]:
    """(takes ``**kwargs``, named keyword parameters) of ``fn``; unknown signature = takes all."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True, set()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return any(p.kind is p.VAR_KEYWORD for p in params), names


@dataclass
class _Member:
    key: str  # unique name in per_fn / metrics
    spec: RewardSpec
    fn: Callable[..., Any]
    var_kw: bool
    accepted: set[str]
    abandoned: list[threading.Thread] = field(default_factory=list)

    def kwargs(self, answers: list[str], fields: dict[str, list[Any]]) -> dict[str, Any]:
        """Keyword arguments for one call: every field plus ``answers`` (and ``solution``, the
        R1-V / open-r1 name of the ground-truth column, for a function that names it); a function
        without ``**kwargs`` gets only the names it declares."""
        kw: dict[str, Any] = {k: v for k, v in fields.items() if k not in ("completions", "answers")}
        kw["answers"] = answers
        if "solution" in self.accepted and "solution" not in kw:
            kw["solution"] = answers
        if self.var_kw:
            return kw
        return {k: v for k, v in kw.items() if k in self.accepted}


class RewardSet:
    """The configured reward functions with their weights, timeout and debug log."""

    def __init__(
        self,
        cfg: RewardsConfig | Config | RoleConfig | Sequence[RewardSpec | Mapping[str, Any]] | None = None,
        *,
        default_params: Mapping[str, Any] | None = None,
    ):
        """Build every function now (a wrong name or parameter fails here, at start-up).

        ``default_params`` (e.g. ``{"think_tag": "reasoning"}``) go to every built-in that accepts
        them unless its own ``params`` set them; a full :class:`Config` (or a role's view of it) supplies the data
        section's ``think_tag``/``answer_tag`` this way.
        """
        defaults = dict(default_params or {})
        if isinstance(cfg, (Config, RoleConfig)):
            defaults = {"think_tag": cfg.data.think_tag, "answer_tag": cfg.data.answer_tag, **defaults}
            if cfg.data.prompt_format == "no_think":
                defaults["think_tag"] = None
            cfg = cfg.rewards
        if cfg is None:
            cfg = RewardsConfig()
        elif not isinstance(cfg, RewardsConfig):
            cfg = RewardsConfig.model_validate(list(cfg))
        self.cfg = cfg
        self.timeout_s = float(cfg.timeout_s)
        self.debug_log = Path(cfg.debug_log) if cfg.debug_log else None
        self._log_lock = threading.Lock()
        self.members: list[_Member] = []
        seen: dict[str, int] = {}
        for spec in cfg.functions:
            params = dict(spec.params)
            accepted = factory_params(spec.name)
            for k, v in defaults.items():
                if accepted is not None and k in accepted and k not in params:
                    if v is None and canonical_name(spec.name) in _NEED_THINK_TAG:
                        continue  # the cookbook family always has a reasoning tag
                    params[k] = v
            fn = get(spec.name, **params)
            seen[spec.name] = seen.get(spec.name, 0) + 1
            key = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
            var_kw, names = _accepts_var_kw(fn)
            self.members.append(_Member(key, spec, fn, var_kw, names))

    @classmethod
    def from_config(cls, cfg: RewardsConfig | Config, **kwargs: Any) -> RewardSet:
        """Same as ``RewardSet(cfg)``."""
        return cls(cfg, **kwargs)

    @property
    def names(self) -> list[str]:
        """Keys of ``per_fn``: config names, ``name#2`` for a repeated one."""
        return [m.key for m in self.members]

    @property
    def weights(self) -> dict[str, float]:
        return {m.key: float(m.spec.weight) for m in self.members}

    # ------------------------------------------------------------------------------ scoring
    def score(
        self,
        completions: Sequence[str],
        answer: str,
        *,
        prompt_id: str = "",
        fields: Mapping[str, Any] | None = None,
        observe: bool = True,
    ) -> ScoredRewards:
        """Score one group's completions against its ground truth (see the module docstring).

        ``observe=False`` leaves the ``streamgrpo_reward`` histograms alone (completions that are not
        trained on, or a caller that adds a reward first and then calls :meth:`observe`)."""
        completions = [c if isinstance(c, str) else ("" if c is None else str(c)) for c in completions]
        n = len(completions)
        answers = [answer] * n
        cols = {k: [v] * n for k, v in (fields or {}).items()}
        per_fn: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        totals = [0.0] * n
        for m in self.members:
            values, error = self._call(m, completions, answers, cols) if n else ([], None)
            if error is not None:
                errors[m.key] = error
                ERRORS.labels(kind="reward").inc()
                log.warning("reward %r failed (prompt %r): %s", m.key, prompt_id, error)
            per_fn[m.key] = values
            weight = float(m.spec.weight)
            for i, v in enumerate(values):
                totals[i] += weight * v
        scored = ScoredRewards(totals=totals, per_fn=per_fn, errors=errors)
        if observe:
            self.observe(scored)
        if self.debug_log is not None:
            self._write_debug(scored, completions, answer, prompt_id)
        return scored

    @staticmethod
    def observe(scored: ScoredRewards) -> None:
        """Count a group's rewards in the ``streamgrpo_reward`` histograms (per function and total)."""
        for key, values in scored.per_fn.items():
            hist = REWARD.labels(fn=key)
            for v in values:
                hist.observe(v)
        total_hist = REWARD.labels(fn="total")
        for t in scored.totals:
            total_hist.observe(t)

    def _call(
        self, m: _Member, completions: list[str], answers: list[str], cols: dict[str, list[Any]]
    ) -> tuple[list[float], str | None]:
        """One guarded call: (values, error or None); bad values become 0."""
        n = len(completions)
        zeros = [0.0] * n
        m.abandoned = [t for t in m.abandoned if t.is_alive()]
        if len(m.abandoned) >= MAX_ABANDONED:
            return (
                zeros,
                f"skipped: {len(m.abandoned)} earlier calls still running past the {self.timeout_s}s timeout",
            )
        try:
            raw = self._run_with_timeout(m, completions, m.kwargs(answers, cols))
        except RewardTimeout as exc:
            return zeros, str(exc)
        except Exception as exc:  # a user reward may raise anything
            return zeros, f"raised {type(exc).__name__}: {exc}"
        if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
            return zeros, f"returned {type(raw).__name__}, expected a list of {n} floats"
        try:
            raw = list(raw)
        except Exception as exc:
            return zeros, f"returned an unreadable {type(raw).__name__}: {exc}"
        if len(raw) != n:
            return zeros, f"returned {len(raw)} values for {n} completions"
        values, bad = [], []
        for i, v in enumerate(raw):
            if v is None:
                values.append(0.0)
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not math.isfinite(f):
                bad.append(f"[{i}]={v!r}")
                f = 0.0
            values.append(f)
        if bad:
            return values, f"returned non-finite or non-numeric values {', '.join(bad[:8])}"
        return values, None

    def _run_with_timeout(self, m: _Member, completions: list[str], kwargs: dict[str, Any]) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = m.fn(completions, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"reward:{m.key}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            m.abandoned.append(thread)
            raise RewardTimeout(f"timed out after {self.timeout_s}s (call abandoned in a daemon thread)")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # ----------------------------------------------------------------------------- debug log
    def _write_debug(
        self, scored: ScoredRewards, completions: list[str], answer: str, prompt_id: str
    ) -> None:
        now = time.time()
        lines = []
        for i, text in enumerate(completions):
            record = {
                "time": now,
                "prompt_id": prompt_id,
                "index": i,
                "completion": text,
                "rewards": scored.for_completion(i),
                "reward": scored.totals[i],
                "answer": answer,
            }
            if scored.errors:
                record["errors"] = scored.errors
            lines.append(json.dumps(record, ensure_ascii=False, default=str))
        try:
            with self._log_lock:
                self.debug_log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.debug_log, "a", encoding="utf-8") as fh:
                    fh.write("\n".join(lines) + "\n")
        except OSError as exc:
            ERRORS.labels(kind="reward").inc()
            log.warning("reward debug log %s: cannot write: %s", self.debug_log, exc)
