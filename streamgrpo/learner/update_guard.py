"""A bound on how far one optimizer step may move the policy (``learner.max_update_kl``).

Adam moves every weight by up to about the learning rate whatever the gradient's size, so clipping
the gradient norm does not bound a step: on the motion demo one step at lr 1e-3 took the KL to the
reference from ~0.01 to 3.5 and left no answer right for the rest of the run. The guard measures
each step's change on the step's own completions,

    update_kl = mean over completion tokens of  exp(d) - d - 1,   d = logp_new - logp_old

(the k3 estimate of KL(old || new): the tokens were sampled from about the old policy), and while it
is above the bound halves the step along its own direction (a backtracking line search, as TRPO
does), at most ``max_halvings`` times; a step still too large after that is undone. Adam's moments
keep the gradient either way.

Pure parts here (:func:`kl_terms`, :func:`backtrack`); :class:`~streamgrpo.learner.trainer.Learner` measures
and moves the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["UpdateCheck", "backtrack", "kl_terms", "shrink_towards"]


@dataclass(frozen=True)
class UpdateCheck:
    """What the line search did to one step."""

    kl_first: float
    """update_kl of the full step."""
    kl: float
    """update_kl of the step as applied (0.0 when undone)."""
    scale: float
    """Fraction of the full step applied: 1.0, 0.5, 0.25, ...; 0.0 = undone."""
    halvings: int

    @property
    def undone(self) -> bool:
        return self.scale == 0.0


def kl_terms(old_lp: torch.Tensor, new_lp: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """``(sum of exp(d) - d - 1 over masked tokens, masked token count)`` with d = new - old (both (B, L))."""
    if old_lp.shape != new_lp.shape or old_lp.shape != mask.shape:
        raise ValueError(f"log-prob shapes differ: old {tuple(old_lp.shape)}, new {tuple(new_lp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    keep = mask.to(torch.bool)
    d = (new_lp.float() - old_lp.float())[keep]
    return float((torch.expm1(d) - d).sum()), int(keep.sum())


def backtrack(measure: Callable[[], float], shrink: Callable[[float], None], max_kl: float,
              max_halvings: int) -> UpdateCheck:
    """Halve the applied step while ``measure()`` (its update_kl) exceeds ``max_kl``.

    ``shrink(f)`` scales the step as applied now by ``f`` (0.5: halve; 0.0: undo). A non-finite
    measurement counts as too large.
    """
    if max_kl <= 0 or max_halvings < 0:
        raise ValueError(f"max_kl must be > 0 and max_halvings >= 0, got {max_kl}, {max_halvings}")
    first = kl = measure()
    scale, halvings = 1.0, 0

    def too_big(x: float) -> bool:
        return not x <= max_kl  # nan is too big

    while too_big(kl) and halvings < max_halvings:
        shrink(0.5)
        scale *= 0.5
        halvings += 1
        kl = measure()
    if too_big(kl):
        shrink(0.0)
        return UpdateCheck(kl_first=first, kl=0.0, scale=0.0, halvings=halvings)
    return UpdateCheck(kl_first=first, kl=kl, scale=scale, halvings=halvings)


def shrink_towards(params: list[torch.Tensor], before: list[torch.Tensor], f: float) -> None:
    """``p = before + f * (p - before)`` for every parameter, in place."""
    with torch.no_grad():
        for p, b in zip(params, before, strict=True):
            p.lerp_(b, 1.0 - f)
