"""The live agreement guard: do the generators still compute the learner's policy? (pure)

Every step the learner measures KL(behaviour || learner) (k3) on the tokens a generator sampled with
the learner's current weights (staleness 0: each token's own policy version equals the learner's).
Those tokens should agree to rounding (bf16 engines: 0.0004-0.01); a mismatch that appears mid-run
(a vLLM upgrade, a weight-apply bug, a transformers release that drops an argument) shows as a KL
well above that. The guard keeps the token-weighted mean over the last ``window`` steps that had
such tokens; past ``max_kl`` it says so in one warning line, once, until the mean is back under it.
The learner exports the mean as ``streamgrpo_learner_agreement_kl`` (alert
``StreamgrpoGeneratorLearnerMismatch`` in deploy/prometheus/rules.yml).

In an asynchronous run almost no token is at staleness 0 (the generators sample ahead of the learner),
so that check alone goes blind after the first steps. :class:`DriftGuard` watches the older tokens:
each staleness bucket (1, 2, 3+) against its own recent history (KL and mean log-ratio), and warns when
one jumps. Both are pure; the learner loop feeds them each step's sums.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class AgreementGuard:
    max_kl: float
    window: int
    steps: deque = field(default_factory=deque)  # (kl sum, tokens) of the last steps with fresh tokens
    firing: bool = False

    @classmethod
    def from_config(cls, lc) -> AgreementGuard:
        """From the ``learner`` section (``agreement_max_kl``, ``agreement_window``)."""
        return cls(max_kl=lc.agreement_max_kl, window=lc.agreement_window)

    def mean(self) -> float | None:
        """Token-weighted KL over the window (None: no staleness-0 token seen yet)."""
        tokens = sum(n for _, n in self.steps)
        return sum(s for s, _ in self.steps) / tokens if tokens else None

    def observe(self, kl_sum: float, tokens: int) -> str | None:
        """Add one step's staleness-0 tokens; the warning line when the window's mean first passes
        ``max_kl`` (None otherwise, and while it stays past it)."""
        if tokens > 0:
            self.steps.append((float(kl_sum), int(tokens)))
            while len(self.steps) > self.window:
                self.steps.popleft()
        kl = self.mean()
        if kl is None or kl <= self.max_kl:
            self.firing = False
            return None
        if self.firing:
            return None
        self.firing = True
        n = sum(t for _, t in self.steps)
        return (f"generators and learner disagree: KL {kl:.4g} > {self.max_kl:g} (learner.agreement_max_kl) on "
                f"{n} tokens sampled with the learner's current weights over the last {len(self.steps)} steps; "
                "run `streamgrpo check agreement` with this config to find the cause (docs/training.md)")


# ---------------------------------------------------------------------------------- stale tokens
BUCKETS: tuple[str, ...] = ("0", "1", "2", "3+")
"""Token staleness buckets (learner version minus the version a token was sampled with)."""


def bucket_of(staleness: int) -> int:
    """The index in :data:`BUCKETS` of a token of this staleness (3 and older share the last)."""
    return min(max(int(staleness), 0), len(BUCKETS) - 1)


@dataclass
class BucketSums:
    """One step's tokens of one staleness bucket: count, k3 KL(behaviour || learner) summed, and the log-ratio
    log pi_learner - log pi_behaviour summed (a constant shift of the behaviour log-probs moves its mean by
    exactly the shift)."""

    tokens: int = 0
    kl_sum: float = 0.0
    log_ratio_sum: float = 0.0

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else math.nan

    @property
    def log_ratio(self) -> float:
        return self.log_ratio_sum / self.tokens if self.tokens else math.nan

    def to_list(self) -> list:
        return [self.tokens, self.kl_sum, self.log_ratio_sum]

    @classmethod
    def from_list(cls, x) -> BucketSums:
        return cls(int(x[0]), float(x[1]), float(x[2]))


def add_buckets(parts: list[list[BucketSums]]) -> list[BucketSums]:
    """Bucket-wise sums (micro-batches, ranks)."""
    out = [BucketSums() for _ in BUCKETS]
    for part in parts:
        for o, p in zip(out, part):
            o.tokens += p.tokens
            o.kl_sum += p.kl_sum
            o.log_ratio_sum += p.log_ratio_sum
    return out


@dataclass
class StaleVerdict:
    """What :meth:`DriftGuard.observe` saw in one bucket this step (None fields: too few tokens, or no history yet)."""

    bucket: str
    kl: float
    log_ratio: float
    baseline_kl: float | None
    baseline_log_ratio: float | None
    off: bool
    firing: bool
    warning: str | None = None
    """The warning line when this bucket starts firing with this step (None otherwise)."""


@dataclass
class DriftGuard:
    """Agreement on stale tokens: each staleness bucket (1, 2, 3+) against its own recent history.

    A token sampled ``s`` versions ago legitimately differs from the learner (the weights moved since), so
    its KL is not ~0 as at staleness 0; but for a given learning rate and staleness it is stable from step
    to step, and under agreement the mean log-ratio is about minus that KL. A mismatch that appears
    mid-run (a generator that starts computing another policy) jumps both at once. Per bucket the guard
    keeps the step means of the last ``history`` steps it judged normal (steps with at least
    ``min_tokens`` tokens of that bucket); once it has ``min_history`` of them a step is *off* when

    * its KL > ``kl_factor`` x the history's median KL + ``max_kl``, or
    * its mean log-ratio is further than max(``max_shift``, 6 robust sigmas (1.4826 x MAD)) from the
      history's median.

    ``confirm`` off steps in a row (one outlier is not enough) give one warning line for that bucket; it
    stays firing (no further line) until a normal step. Off steps never enter the history, so a lasting
    mismatch keeps firing rather than becoming the new normal; slow drift (a warm-up, a decaying learning
    rate) moves the median step by step and never trips it.
    """

    max_kl: float
    kl_factor: float = 3.0
    max_shift: float = 0.25
    history: int = 20
    min_history: int = 5
    min_tokens: int = 16
    confirm: int = 2
    kl_hist: list = field(default_factory=list)
    lr_hist: list = field(default_factory=list)
    strikes: list = field(default_factory=list)
    firing: list = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(BUCKETS)
        self.kl_hist = [deque() for _ in range(n)]
        self.lr_hist = [deque() for _ in range(n)]
        self.strikes = [0] * n
        self.firing = [False] * n

    @classmethod
    def from_config(cls, lc) -> DriftGuard:
        """From the ``learner`` section (``agreement_max_kl``, ``agreement_kl_factor``, ``agreement_max_shift``,
        ``agreement_history``)."""
        return cls(max_kl=lc.agreement_max_kl, kl_factor=lc.agreement_kl_factor, max_shift=lc.agreement_max_shift,
                   history=lc.agreement_history)

    def observe(self, sums: list[BucketSums]) -> tuple[list[StaleVerdict], list[str]]:
        """One step's buckets (index = :data:`BUCKETS`; bucket 0 is :class:`AgreementGuard`'s): a verdict per
        judged bucket (1, 2, 3+ with enough tokens) and the warning lines of buckets that start firing."""
        verdicts, lines = [], []
        for b in range(1, len(BUCKETS)):
            s = sums[b] if b < len(sums) else BucketSums()
            if s.tokens < self.min_tokens:
                continue
            v = self._judge(b, s.kl, s.log_ratio)
            verdicts.append(v)
            if v.off and v.firing and self.strikes[b] == self.confirm:
                v.warning = self._line(v, s.tokens)
                lines.append(v.warning)
        return verdicts, lines

    def _judge(self, b: int, kl: float, lr: float) -> StaleVerdict:
        kh, lh = self.kl_hist[b], self.lr_hist[b]
        if not (math.isfinite(kl) and math.isfinite(lr)):
            off, base_kl, base_lr = True, None, None
        elif len(kh) < self.min_history:
            off, base_kl, base_lr = False, None, None
        else:
            base_kl, base_lr = statistics.median(kh), statistics.median(lh)
            mad = 1.4826 * statistics.median(abs(x - base_lr) for x in lh)
            off = kl > self.kl_factor * base_kl + self.max_kl or abs(lr - base_lr) > max(self.max_shift, 6 * mad)
        if off:
            self.strikes[b] += 1
            if self.strikes[b] >= self.confirm:
                self.firing[b] = True
        else:
            self.strikes[b] = 0
            self.firing[b] = False
            kh.append(kl)
            lh.append(lr)
            while len(kh) > self.history:
                kh.popleft()
                lh.popleft()
        return StaleVerdict(BUCKETS[b], kl, lr, base_kl, base_lr, off, self.firing[b])

    def _line(self, v: StaleVerdict, tokens: int) -> str:
        base = ("" if v.baseline_kl is None else
                f" (its last {len(self.kl_hist[BUCKETS.index(v.bucket)])} normal steps: KL {v.baseline_kl:.4g}, "
                f"log-ratio {v.baseline_log_ratio:+.4g})")
        return (f"generators and learner disagree on tokens {v.bucket} version(s) old: KL {v.kl:.4g}, mean "
                f"log-ratio {v.log_ratio:+.4g} on {tokens} tokens for {self.confirm} steps{base}; past "
                f"{self.kl_factor:g} x its KL + {self.max_kl:g} (learner.agreement_kl_factor) or a log-ratio "
                f"shift of {self.max_shift:g} (learner.agreement_max_shift); run `streamgrpo check agreement` "
                "with this config to find the cause (docs/training.md)")
