"""The live agreement guard: do the generators still compute the learner's policy? (pure)

Every step the learner measures KL(behaviour || learner) (k3) on the tokens a generator sampled with
the learner's current weights (staleness 0: each token's own policy version equals the learner's).
Those tokens should agree to rounding (bf16 engines: 0.0004-0.01); a mismatch that appears mid-run
(a vLLM upgrade, a weight-apply bug, a transformers release that drops an argument) shows as a KL
well above that. The guard keeps the token-weighted mean over the last ``window`` steps that had
such tokens; past ``max_kl`` it says so in one warning line, once, until the mean is back under it.
The learner exports the mean as ``streamgrpo_learner_agreement_kl`` (alert
``StreamgrpoGeneratorLearnerMismatch`` in deploy/prometheus/alerts.yml).
"""

from __future__ import annotations

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
