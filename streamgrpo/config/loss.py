"""The ``loss`` section: the clipped GRPO objective, advantages, off-policy corrections, staleness."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from streamgrpo.sections import Section


class LossConfig(Section):
    epsilon: float = Field(0.2, ge=0.0, le=10.0)
    """Lower clip: ratios below 1-epsilon stop contributing gradient (for A<0)."""
    epsilon_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper clip: ratios above 1+epsilon_high stop contributing gradient (for A>0)."""
    beta: float = Field(0.0, ge=0.0, le=100.0)
    """KL (k3) penalty weight against the reference model; 0 loads no reference model."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Token aggregation: grpo (per-sequence mean), bnpo (batch token mean), dr_grpo (sum / B*L), dapo (global token mean)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's std, the batch std, or not at all."""
    adv_eps: float = Field(1e-4, gt=0.0, le=1.0)
    """Added to the std when scaling advantages."""
    tis_cap: Optional[float] = Field(None, gt=0.0)
    """Truncated importance sampling cap on exp(logp - behaviour logp) (null = off)."""
    is_mask: Optional[Literal["token", "sequence"]] = "token"
    """Masked importance sampling (MIS): drop the objective of tokens (token) or whole completions (sequence, by their geometric-mean ratio) whose exp(logp - behaviour logp) leaves [is_mask_low, is_mask_high]; null = off. Default token: the best final accuracy at lag 8 in the staleness study (benchmarks/bench_staleness.py)."""
    is_mask_low: float = Field(0.5, ge=0.0, lt=1.0)
    """Lower end of the MIS band."""
    is_mask_high: float = Field(2.0, gt=1.0, le=1e6)
    """Upper end of the MIS band."""
    zero_variance_weight: float = Field(0.0, ge=0.0, le=1.0)
    """A group whose rewards are all equal (all wrong, or all right) gets this x (reward - the step's mean reward) / the step's reward std (no division with scale_rewards none; with several learner ranks, each rank's groups of the step) as its advantage instead of zeros: all-wrong answers are pushed down, so a policy that stopped sampling the right one gets a gradient (RL-ZVP's idea); 0 = plain GRPO. Not with drop_zero_variance."""
    drop_zero_variance: bool = False
    """Dynamic sampling (DAPO): drop groups whose G rewards are all equal (no gradient) before the step and take further groups instead (counted as groups_dropped{reason=zero_variance})."""
    fill_timeout_s: float = Field(60.0, gt=0.0, le=86400.0)
    """With drop_zero_variance: how long a step waits for enough informative groups before it trains on what it has (at least one per rank)."""
    ratio_mode: Literal["behaviour", "current", "decoupled"] = "behaviour"
    """Importance ratio of the clipped objective: `behaviour` = exp(logp - behaviour logp) (corrects stale groups); `current` = a naive loss that ignores the behaviour log-probs (staleness benchmark baseline); `decoupled` = decoupled PPO (AReaL): clip around the learner's own policy at the step, times the behaviour weight exp(logp - behaviour logp) (truncated at tis_cap when set)."""
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0)
    """Entropy bonus (verl's ``entropy_coeff``): subtracts this x each completion token's policy entropy (full vocabulary, at the sampling temperature), aggregated like the loss; 0 = off."""

    @model_validator(mode="after")
    def _zero_variance_choice(self):
        if self.drop_zero_variance and self.zero_variance_weight > 0:
            raise ValueError("loss.drop_zero_variance drops the groups loss.zero_variance_weight would train on: set one of them")
        return self
