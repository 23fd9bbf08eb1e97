"""The numbers of one learner step, typed: what a rank's step produces, what the ranks add up, the log line.

Three stages, one type each, and each metric is named once (a field):

* :class:`StepOutput` is what :meth:`~streamgrpo.learner.trainer.Learner.train_step` returns on one rank: its
  share of the loss, the (global) gradient norm, its advantages ``adv_N`` (one per completion) and
  the loss's metrics as :class:`LossStats` (token-weighted means that add up over micro-batches and
  ranks). A dry run returns a :class:`Probe` instead.
* :class:`StepSummary` is one rank's numbers of the step as sums (:meth:`StepSummary.of_rank`,
  JSON for ``gather_json``) or the sum of every rank's (:meth:`StepSummary.merge`).
* :class:`StepRecord` is the ``metrics.jsonl`` line (:meth:`StepRecord.to_json`), built from the merged
  summary; ``report``, ``tracking``, ``up`` and the benchmarks read its keys.

Shape suffixes: ``_N`` one value per completion of the step, ``_G`` one per group.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from streamgrpo.data.cursor import advance, furthest
from streamgrpo.learner.agreement_guard import BUCKETS, BucketSums, add_buckets
from streamgrpo.learner.flops import mfu as utilisation

if TYPE_CHECKING:
    import torch

    from streamgrpo.learner.state import Accepted, LearnerState
    from streamgrpo.learner.update_guard import UpdateCheck


@dataclass
class LossStats:
    """``compute_loss``'s metrics over ``tokens`` completion tokens: token-weighted means (None: the loss
    did not report it) and the importance ratio's extremes. :meth:`merge` adds micro-batches or ranks up."""

    tokens: int = 0
    kl: float | None = None
    entropy: float | None = None
    clip_frac: float | None = None
    clip_frac_low: float | None = None
    clip_frac_high: float | None = None
    ratio_mean: float | None = None
    ratio_sq_mean: float | None = None
    kl_behaviour: float | None = None
    is_masked_frac: float | None = None
    ratio_max: float | None = None
    ratio_min: float | None = None

    @classmethod
    def means(cls) -> tuple[str, ...]:
        """The token-weighted fields (all but ``tokens`` and the ratio's extremes)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("tokens", "ratio_max", "ratio_min"))

    @classmethod
    def from_loss(cls, metrics: dict[str, Any]) -> LossStats:
        """One ``compute_loss`` call's metrics (0-d tensors, ``num_tokens`` among them); the rest are ignored."""
        got = {k: float(metrics[k]) for k in (*cls.means(), "ratio_max", "ratio_min") if metrics.get(k) is not None}
        return cls(tokens=int(metrics["num_tokens"].item()), **got)

    @classmethod
    def merge(cls, parts: list[LossStats]) -> LossStats:
        """Means weighted by each part's tokens (over all parts' tokens), max of maxima, min of minima."""
        tokens = sum(p.tokens for p in parts)
        out = cls(tokens=tokens)
        for name in cls.means():
            weighted = [getattr(p, name) * p.tokens for p in parts if getattr(p, name) is not None]
            if weighted:
                setattr(out, name, sum(weighted, 0.0) / max(tokens, 1))
        for name, pick in (("ratio_max", max), ("ratio_min", min)):
            seen = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            setattr(out, name, pick(seen) if seen else None)
        return out


@dataclass
class Probe:
    """A dry run's answer (``train_step(..., dry_run=True)``): were the loss and the gradient finite."""

    finite: bool


@dataclass
class StepOutput:
    """One applied optimizer step on one rank (see :meth:`~streamgrpo.learner.trainer.Learner.train_step`)."""

    loss: float
    """This rank's share: the ranks' values sum to the step's loss."""
    grad_norm: float
    """Before clipping, of the whole step (identical on every rank)."""
    tokens_global: int
    """Completion tokens of the whole step (all ranks): the ``dapo`` normaliser."""
    zero_variance: int
    """This rank's groups whose rewards were all equal."""
    adv_N: torch.Tensor
    """This rank's advantages, one per completion (groups in order)."""
    micro_batches: int
    seq_logprob_sum: float
    """Completion log-probs summed over this rank's rows (one row per completion)."""
    rows: int
    stats: LossStats
    """The loss's metrics over this rank's completion tokens."""
    seq_tokens: int = 0
    """Prompt + completion tokens of this rank's rows (no padding)."""
    flops: float = 0.0
    """Model FLOPs of this rank's step (:mod:`streamgrpo.learner.flops`)."""
    peak_flops: float | None = None
    """Peak FLOP/s of this rank's device (None: unknown, e.g. a CPU without ``learner.peak_tflops``)."""
    update: UpdateCheck | None = None
    """The ``learner.max_update_kl`` line search's outcome (identical on every rank); None when off."""
    fresh_kl_sum: float = 0.0
    """KL(behaviour || learner) (k3) summed over this rank's staleness-0 tokens (sampled with the learner's
    current weights): the generator = learner agreement the live guard watches."""
    fresh_tokens: int = 0
    """The staleness-0 completion tokens of ``fresh_kl_sum``."""
    staleness_sums: list[BucketSums] = field(default_factory=list)
    """This rank's completion tokens by staleness bucket (0, 1, 2, 3+): count, KL and log-ratio sums (the live
    guard's stale buckets, :class:`~streamgrpo.learner.agreement_guard.DriftGuard`)."""

    @property
    def tokens(self) -> int:
        """This rank's completion tokens."""
        return self.stats.tokens


@dataclass
class StepSummary:
    """One step's numbers as sums that add up over ranks: one rank's (:meth:`of_rank`) or all of them
    (:meth:`merge`). JSON round trip with :meth:`to_json` / :meth:`from_json` (``gather_json``)."""

    groups: int = 0
    group_ids: list[str] = field(default_factory=list)
    completions: int = 0
    reward_sum: float = 0.0
    reward_fn: dict[str, list] = field(default_factory=dict)
    """Reward function -> ``[sum, count]`` over completions that have it."""
    accuracy_G: list[float] | None = None
    """Mean ``accuracy`` reward per group (a completion without one counts 0); None: no completion has one."""
    staleness_G: list[int] = field(default_factory=list)
    token_staleness_sum: float = 0.0
    """Learner version minus each completion token's sampling version, summed over the step's tokens."""
    completion_tokens: int = 0
    """The completion tokens of ``token_staleness_sum``."""
    loss: float = 0.0
    stats: LossStats = field(default_factory=LossStats)
    adv_N: list[float] = field(default_factory=list)
    zero_variance: int = 0
    seq_logprob_sum: float = 0.0
    rows: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    """Groups the gate dropped since the last step, by reason."""
    ranks: int = 1
    seq_tokens: int = 0
    flops: float = 0.0
    peak_flops: float | None = None
    """Summed over ranks; None when any rank's device peak is unknown."""
    fresh_kl_sum: float = 0.0
    fresh_tokens: int = 0
    staleness_sums: list[list] = field(default_factory=list)
    """[tokens, KL sum, log-ratio sum] per staleness bucket (0, 1, 2, 3+)."""
    consumed_at: dict[str, list[int]] = field(default_factory=dict)
    """Per generator shard ``"N/K"``, the furthest ``[epoch, position]`` trained or dropped (the data cursor's move)."""

    @classmethod
    def of_rank(cls, batch: list[Accepted], out: StepOutput, drops: dict[str, int],
                dropped_at: dict | None = None) -> StepSummary:
        """This rank's numbers: its groups ``batch`` and what :meth:`train_step` returned for them; ``dropped_at``:
        the sources of the groups it dropped since the last step (:attr:`Gate.dropped_at`)."""
        completions = [c for a in batch for c in a.group.completions]
        per_fn: dict[str, list] = {}
        for c in completions:
            for k, v in c.rewards.items():
                s = per_fn.setdefault(k, [0.0, 0])
                s[0] += float(v)
                s[1] += 1
        has_acc = any("accuracy" in c.rewards for c in completions)
        return cls(
            groups=len(batch), group_ids=[a.group.group_id for a in batch], completions=len(completions),
            reward_sum=float(sum(c.reward for c in completions)), reward_fn=per_fn,
            accuracy_G=[float(np.mean([c.rewards.get("accuracy", 0.0) for c in a.group.completions]))
                        for a in batch] if has_acc else None,
            staleness_G=[a.staleness for a in batch], token_staleness_sum=_token_staleness_sum(batch),
            completion_tokens=sum(len(c.token_ids) for c in completions),
            loss=float(out.loss), stats=out.stats,
            adv_N=[float(x) for x in out.adv_N.reshape(-1).tolist()], zero_variance=int(out.zero_variance),
            seq_logprob_sum=float(out.seq_logprob_sum), rows=int(out.rows), drops=dict(drops),
            seq_tokens=int(out.seq_tokens), flops=float(out.flops), peak_flops=out.peak_flops,
            fresh_kl_sum=float(out.fresh_kl_sum), fresh_tokens=int(out.fresh_tokens),
            staleness_sums=[b.to_list() for b in out.staleness_sums],
            consumed_at={k: list(v) for k, v in advance(dropped_at or {}, furthest(a.group.source for a in batch)).items()},
        )

    @classmethod
    def of_helper(cls, out: StepOutput) -> StepSummary:
        """A sequence-parallel rank that does not read (``learner.sequence_parallel``): its reader's summary has
        the groups, tokens and loss metrics of the step they computed together; this rank adds its share of the
        loss and its device's peak."""
        return cls(loss=float(out.loss), peak_flops=out.peak_flops)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stats"] = {f.name: getattr(self.stats, f.name) for f in fields(LossStats)}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepSummary:
        return cls(**{**d, "stats": LossStats(**d["stats"])})

    @classmethod
    def merge(cls, parts: list[StepSummary | dict[str, Any]]) -> StepSummary:
        """Add up every rank's summary (in rank order; JSON dicts from ``gather_json`` are fine)."""
        parts = [p if isinstance(p, StepSummary) else cls.from_json(p) for p in parts]
        out = cls(ranks=len(parts))
        peaks = [p.peak_flops for p in parts]
        out.peak_flops = None if any(x is None for x in peaks) else float(sum(peaks))
        drops: Counter = Counter()
        consumed: dict = {}
        for p in parts:
            drops.update(p.drops)
            consumed = advance(consumed, p.consumed_at)
            out.groups += p.groups
            out.completions += p.completions
            out.reward_sum += p.reward_sum
            out.loss += p.loss
            out.zero_variance += p.zero_variance
            out.seq_logprob_sum += p.seq_logprob_sum
            out.rows += p.rows
            out.seq_tokens += p.seq_tokens
            out.flops += p.flops
            out.group_ids += p.group_ids
            out.staleness_G += p.staleness_G
            out.token_staleness_sum += p.token_staleness_sum
            out.completion_tokens += p.completion_tokens
            out.fresh_kl_sum += p.fresh_kl_sum
            out.fresh_tokens += p.fresh_tokens
            out.adv_N += p.adv_N
            if p.accuracy_G is not None:
                out.accuracy_G = (out.accuracy_G or []) + p.accuracy_G
            for k, (s, n) in p.reward_fn.items():
                acc = out.reward_fn.setdefault(k, [0.0, 0])
                acc[0] += s
                acc[1] += n
        out.drops = dict(drops)
        out.consumed_at = {k: list(v) for k, v in consumed.items()}
        out.stats = LossStats.merge([p.stats for p in parts])
        out.staleness_sums = [b.to_list() for b in add_buckets(
            [[BucketSums.from_list(x) for x in p.staleness_sums] for p in parts])]
        return out


@dataclass
class StepRecord:
    """The ``metrics.jsonl`` line of one step (all ranks' groups); the fields are its keys, in order."""

    step: int
    version: int
    time: float
    reward: float
    rewards: dict[str, float]
    accuracy: float | None
    group_accuracy: list[float] | None
    loss: float
    kl: float
    entropy: float | None
    clip_frac: float
    clip_frac_low: float
    clip_frac_high: float
    ratio_mean: float | None
    ratio_max: float | None
    ratio_min: float | None
    grad_norm: float
    ess: float | None
    """Effective sample size fraction of the importance weights: ratio_mean^2 / ratio_sq_mean."""
    kl_behaviour: float | None
    is_masked_frac: float
    adv_mean: float
    adv_std: float
    policy_seq_log_prob: float
    zero_variance_groups: int
    staleness_mean: float
    staleness_max: int
    token_staleness_mean: float
    """Per completion token (in-flight weight updates make a completion's tokens differ in age)."""
    groups_trained: int
    groups_dropped: dict[str, int]
    tokens: int
    completion_len_mean: float
    lr: float
    ranks: int
    micro_batches: int
    seconds: float
    wait_seconds: float
    seq_tokens: int
    """Prompt + completion tokens of the step's rows, all ranks (no padding)."""
    tokens_per_second: float
    """``seq_tokens`` per second of the train part (``seconds``)."""
    model_flops: float
    """Model FLOPs of the step, all ranks (:mod:`streamgrpo.learner.flops`: forward + backward, reference forward)."""
    mfu: float | None
    """Model FLOPs utilisation: model_flops / (seconds x the peak FLOP/s of every learner device); None when a
    device's peak is unknown (a CPU without ``learner.peak_tflops``, an unlisted GPU)."""
    update_kl: float | None = None
    """With ``learner.max_update_kl``: how far the step as applied moved the policy on its own completions."""
    update_scale: float = 1.0
    """Fraction of the optimizer's step applied (``learner.max_update_kl``: 0.5 per halving, 0.0 = undone)."""
    kl_fresh: float | None = None
    """KL(behaviour || learner) on the step's tokens sampled with the learner's current weights (staleness 0):
    the generator = learner agreement (bf16 engines 0.0004-0.01); None when the step had none."""
    fresh_tokens: int = 0
    """Completion tokens of the step sampled with the learner's current weights (all ranks)."""
    staleness_tokens: dict[str, int] = field(default_factory=dict)
    """Completion tokens by staleness bucket ("0", "1", "2", "3+"), all ranks."""
    staleness_kl: dict[str, float] = field(default_factory=dict)
    """KL(behaviour || learner) (k3) by staleness bucket (buckets with tokens): steady per bucket while the
    generators compute the learner's policy; the live guard compares each with its own history."""
    staleness_log_ratio: dict[str, float] = field(default_factory=dict)
    """Mean log-ratio (learner minus behaviour log-prob) by staleness bucket: about minus the KL under
    agreement; a generator whose log-probs are off by d moves it by -d."""

    def staleness_buckets(self) -> list[BucketSums]:
        """The step's :class:`BucketSums` per bucket, for the live guard."""
        out = []
        for b in BUCKETS:
            n = self.staleness_tokens.get(b, 0)
            out.append(BucketSums(n, self.staleness_kl.get(b, 0.0) * n, self.staleness_log_ratio.get(b, 0.0) * n))
        return out

    @classmethod
    def build(cls, state: LearnerState, merged: StepSummary, out: StepOutput, step_s: float, wait_s: float,
              lr: float) -> StepRecord:
        """The line of the step just counted in ``state``: ``merged`` all ranks' summaries, ``out`` this rank's."""
        rewards = {k: s / max(n, 1) for k, (s, n) in merged.reward_fn.items()}
        w = merged.stats
        adv = np.asarray(merged.adv_N, dtype=np.float64)
        stale = merged.staleness_G
        completions = max(merged.completions, 1)
        return cls(
            step=state.step, version=state.version, time=time.time(),
            reward=merged.reward_sum / completions, rewards=rewards,
            accuracy=rewards.get("accuracy"), group_accuracy=merged.accuracy_G, loss=merged.loss,
            kl=_or(w.kl, 0.0), entropy=w.entropy, clip_frac=_or(w.clip_frac, 0.0),
            clip_frac_low=_or(w.clip_frac_low, 0.0), clip_frac_high=_or(w.clip_frac_high, 0.0),
            ratio_mean=w.ratio_mean, ratio_max=w.ratio_max, ratio_min=w.ratio_min, grad_norm=out.grad_norm,
            # at most 1 (Cauchy-Schwarz); the two means are float32 reductions, 1 + 6e-8 when every ratio is 1
            ess=min(1.0, w.ratio_mean ** 2 / w.ratio_sq_mean) if w.ratio_sq_mean else None,
            kl_behaviour=w.kl_behaviour, is_masked_frac=_or(w.is_masked_frac, 0.0),
            adv_mean=float(adv.mean()) if adv.size else 0.0, adv_std=float(adv.std(ddof=1)) if adv.size > 1 else 0.0,
            policy_seq_log_prob=merged.seq_logprob_sum / max(merged.rows, 1),
            zero_variance_groups=merged.zero_variance,
            staleness_mean=float(np.mean(stale)), staleness_max=int(max(stale)),
            token_staleness_mean=merged.token_staleness_sum / max(merged.completion_tokens, 1),
            groups_trained=state.groups_trained, groups_dropped=dict(state.dropped), tokens=w.tokens,
            completion_len_mean=w.tokens / completions, lr=lr, ranks=merged.ranks,
            micro_batches=out.micro_batches, seconds=step_s, wait_seconds=wait_s,
            seq_tokens=merged.seq_tokens, tokens_per_second=merged.seq_tokens / step_s if step_s > 0 else 0.0,
            model_flops=merged.flops, mfu=utilisation(merged.flops, step_s, merged.peak_flops),
            update_kl=None if out.update is None else out.update.kl,
            update_scale=1.0 if out.update is None else out.update.scale,
            kl_fresh=merged.fresh_kl_sum / merged.fresh_tokens if merged.fresh_tokens else None,
            fresh_tokens=merged.fresh_tokens,
            **_by_staleness([BucketSums.from_list(x) for x in merged.staleness_sums]),
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _by_staleness(sums: list[BucketSums]) -> dict[str, dict]:
    """StepRecord's ``staleness_*`` fields from the merged bucket sums (buckets without tokens left out)."""
    have = [(b, s) for b, s in zip(BUCKETS, sums) if s.tokens]
    return {"staleness_tokens": {b: s.tokens for b, s in have}, "staleness_kl": {b: s.kl for b, s in have},
            "staleness_log_ratio": {b: s.log_ratio for b, s in have}}


def _token_staleness_sum(batch: list[Accepted]) -> float:
    total = 0.0
    for a in batch:
        learner_version = a.staleness + int(a.group.policy_version)
        for c in a.group.completions:
            n = len(c.token_ids)
            total += a.staleness * n if c.versions is None else float(learner_version * n - np.sum(c.versions, dtype=np.int64))
    return total


def _or(x: float | None, default: float) -> float:
    return default if x is None else x
