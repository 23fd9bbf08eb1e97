"""Do the generator and the learner compute the same policy? The numbers and the verdict (pure).

At staleness 0 (the generator sampled with exactly the learner's weights) the behaviour log-prob
``b`` a generator reports for a token and the learner's own log-prob ``l`` of it should be equal up
to floating-point rounding. With ``d = l - b`` per token and the importance ratio ``w = exp(d)``:

* ``kl``: mean of ``(w - 1) - d``, the k3 estimate of KL(behaviour || learner) from the tokens the
  behaviour policy sampled (the learner's ``kl_behaviour``). bf16 engines measure 0.0004-0.01; fp32
  on one machine: 0 to rounding. A learner that does not see the video reads as KL ~0.7 on a
  random model.
* ``ess``: mean(w)^2 / mean(w^2), the effective sample size fraction: 1 when every ratio is equal.
* ``abs_delta`` quantiles (p50, p90, p99, max) and the ratio's range: how far single tokens go.

:func:`verdict` turns a baseline measurement and the measurements with one switch each flipped
(fp32, eager attention, vision per row, ...) into one line: agree; disagree, explained by the first
switch under which they agree; or disagree by logic (no switch explains it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_MAX_KL = 0.01
"""KL(behaviour || learner) at staleness 0 past which the two roles are said to disagree: the top of
what bf16 engines report (verl, vLLM vs FSDP), 25x below what a learner blind to the video shows."""


@dataclass(frozen=True)
class Agreement:
    """How far the learner's log-probs are from the behaviour log-probs over ``tokens`` tokens."""

    tokens: int
    kl: float
    ess: float
    abs_delta_p50: float
    abs_delta_p90: float
    abs_delta_p99: float
    abs_delta_max: float
    ratio_min: float
    ratio_max: float

    @classmethod
    def of(cls, learner: Sequence[np.ndarray], behaviour: Sequence[np.ndarray]) -> Agreement:
        """From per-completion arrays of log-probs (the same tokens, in the same order)."""
        if len(learner) != len(behaviour) or any(len(a) != len(b) for a, b in zip(learner, behaviour)):
            raise ValueError("learner and behaviour log-probs must cover the same completions and tokens")
        lp = np.concatenate([np.asarray(a, np.float64) for a in learner]) if learner else np.zeros(0)
        bp = np.concatenate([np.asarray(b, np.float64) for b in behaviour]) if behaviour else np.zeros(0)
        if lp.size == 0:
            return cls(0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0)
        d = np.clip(lp - bp, -50.0, 50.0)  # a token one side gives -inf would make every mean inf
        w = np.exp(d)
        a = np.abs(d)
        return cls(tokens=int(d.size), kl=float(np.mean(np.expm1(d) - d)),
                   ess=float(np.mean(w) ** 2 / np.mean(w * w)),
                   abs_delta_p50=float(np.quantile(a, 0.5)), abs_delta_p90=float(np.quantile(a, 0.9)),
                   abs_delta_p99=float(np.quantile(a, 0.99)), abs_delta_max=float(a.max()),
                   ratio_min=float(w.min()), ratio_max=float(w.max()))

    def agrees(self, max_kl: float = DEFAULT_MAX_KL) -> bool:
        return self.kl <= max_kl

    def describe(self) -> str:
        return (f"KL {self.kl:.4g}, |d log p| p50 {self.abs_delta_p50:.3g} p90 {self.abs_delta_p90:.3g} "
                f"p99 {self.abs_delta_p99:.3g} max {self.abs_delta_max:.3g}, ratio {self.ratio_min:.3g}-"
                f"{self.ratio_max:.3g}, ESS {self.ess:.3f} ({self.tokens} tokens)")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Switch:
    """One setting the agreement check flips to find what explains a disagreement."""

    name: str
    hint: str  # what to do when this switch is what makes them agree


SWITCHES = (
    Switch("vision per row", "the learner's vision-once path is not what the model computes on the installed "
                             "transformers: install the tested release (constraints.txt), or report it"),
    Switch("fp32", "a precision difference: compute both roles' last projection in float32 "
                   "(model.fp32_lm_head: true), or use the same dtype in both (model.dtype, learner.bf16)"),
    Switch("eager attention", "the attention kernels differ between the roles: set model.attn_implementation "
                              "to one both run (sdpa or eager)"),
    Switch("one prompt per batch", "batching several prompts changes the generator's numbers (padding, batch-"
                                   "variant kernels): rollout.prompts_per_batch: 1"),
    Switch("no KV cache", "the engine's incremental decoding differs from a full forward: try another "
                          "attention implementation or engine"),
)
BY_NAME = {s.name: s for s in SWITCHES}


@dataclass(frozen=True)
class Verdict:
    agree: bool
    cause: str  # "" (agree), a switch's name, or "logic"
    line: str


def verdict(base: Agreement, tried: dict[str, Agreement], max_kl: float = DEFAULT_MAX_KL) -> Verdict:
    """One line: agree, or disagree and why. ``tried``: the measurements with one switch flipped each,
    in the order they were tried (a switch that could not be tried is left out)."""
    if base.agrees(max_kl):
        return Verdict(True, "", f"generator and learner agree: {base.describe()} (at most KL {max_kl:g})")
    head = f"generator and learner disagree: KL {base.kl:.4g} > {max_kl:g} ({base.describe()})"
    for name, got in tried.items():
        if got.agrees(max_kl):
            return Verdict(False, name, f"{head}; with {name} they agree (KL {got.kl:.4g}): {BY_NAME[name].hint}")
    named = ", ".join(f"{n} {a.kl:.3g}" for n, a in tried.items()) or "none tried"
    return Verdict(False, "logic", f"{head}; no single switch explains it (KL with {named}): the roles compute "
                                   "different things (weights, prompt, positions, temperature); see docs/training.md")
