"""Group-relative advantages (GRPO) from the rewards of one or many prompt groups.

For a group of G completions of one prompt with rewards ``r_1..r_G``::

    A_i = (r_i - mean(r)) / (std + eps)      scale_rewards="group": std of this group's rewards
                                             scale_rewards="batch": std of all rewards in the batch
    A_i =  r_i - mean(r)                     scale_rewards="none"  (Dr. GRPO, Liu et al. 2025)

The mean is always the group's own. ``std`` is the unbiased (n-1) standard deviation, as in TRL's
GRPOTrainer; "batch" scaling (group mean, batch std) follows Liu et al. 2025, "Tricks or Traps".
A group whose rewards are all equal carries no learning signal: its advantages are exact zeros
(not merely ~1e-17 from rounding) and it is flagged in the zero-variance mask. With
``loss.drop_zero_variance`` the learner's gate drops such groups before the step
(:func:`is_zero_variance`; counted as ``reason="zero_variance"``) and takes further groups instead.

With ``zero_variance_weight`` λ > 0 (``loss.zero_variance_weight``) a zero-variance group is
measured against the batch instead::

    A_i = λ · (r_i - mean(batch)) / (std(batch) + eps)     (no division with scale_rewards="none")

so a group whose G answers are all wrong pushes those answers down, and one whose answers are all
right pushes them up, relative to the step's mean reward (the idea of RL-ZVP, Le et al. 2025,
without its entropy weighting). Under plain GRPO a policy that has stopped sampling the right
answer for some inputs gets no gradient from them and never samples it again; this gives it one.
"The batch" is what the caller passes: the learner passes each rank's groups of the step.
Groups with mixed rewards keep their group-relative advantages. Such groups stay flagged in the
zero-variance mask (their rewards are still all equal); a batch whose rewards are all equal gives
exact zeros.

Groups may differ in size (a group can lose completions, e.g. to a reward timeout or a bad message),
so the batched form also accepts a list of 1-D tensors. Arithmetic runs in float64; results come
back in the rewards' floating dtype (float32 for integer rewards).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]
_SCALES = ("group", "batch", "none")

__all__ = ["AdvantageError", "ScaleRewards", "group_advantages", "batch_advantages", "is_zero_variance"]


class AdvantageError(ValueError):
    """Rewards or options the advantages cannot be computed from. Nothing here counts it: the caller
    (the learner) counts it as ``streamgrpo_errors_total{kind=...}`` with :attr:`kind`: ``"reward"``
    for a non-finite reward, ``"loss"`` for a bad shape or setting."""

    def __init__(self, message: str, kind: str = "loss"):
        super().__init__(message)
        self.kind = kind


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """All rewards of a group equal (no learning signal): the test :func:`batch_advantages` flags."""
    return len(rewards) == 0 or max(rewards) == min(rewards)


def _check(rewards: Tensor, where: str) -> None:
    if rewards.ndim != 1:
        raise AdvantageError(
            f"{where}: rewards must be 1-D (one value per completion), got shape {tuple(rewards.shape)}"
        )
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        raise AdvantageError(f"{where}: rewards must be finite, got {rewards.tolist()}", kind="reward")


def _check_scale(scale_rewards: str) -> None:
    if scale_rewards not in _SCALES:
        raise AdvantageError(f"scale_rewards={scale_rewards!r}: must be one of {', '.join(_SCALES)}")


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _std(x_64: Tensor) -> Tensor:
    """Unbiased std; 0 for fewer than two values (such a group has zero variance anyway)."""
    if x_64.numel() < 2:
        return x_64.new_zeros(())
    return x_64.std(correction=1)


def _centred_scaled(rewards_64: Tensor, std_64: Tensor | None, eps: float) -> tuple[Tensor, bool]:
    """(r - mean) / (std + eps) for one group (no division when std is None); exact zeros if all equal."""
    if rewards_64.numel() == 0:
        return rewards_64.clone(), True
    zero_var = bool(rewards_64.max() == rewards_64.min())
    if zero_var:
        return torch.zeros_like(rewards_64), True
    adv = rewards_64 - rewards_64.mean()
    if std_64 is not None:
        adv = adv / (std_64 + eps)
    return adv, False


def group_advantages(rewards_G: Tensor, scale_rewards: ScaleRewards = "group", eps: float = 1e-4) -> Tensor:
    """Advantages of one group: ``(r - mean) / (std + eps)`` (see the module docstring).

    ``rewards_G`` is 1-D (G,). With a single group, "batch" scaling uses this group's std (the group
    is the whole batch). All-equal rewards give exact zeros.
    """
    _check_scale(scale_rewards)
    rewards_G = torch.as_tensor(rewards_G)
    _check(rewards_G, "group_advantages")
    r_64 = rewards_G.to(torch.float64)
    std = None if scale_rewards == "none" else _std(r_64)
    adv, _ = _centred_scaled(r_64, std, eps)
    return adv.to(_out_dtype(rewards_G))


@overload
def batch_advantages(
    rewards: Tensor, scale_rewards: ScaleRewards = ..., eps: float = ..., zero_variance_weight: float = ...
) -> tuple[Tensor, Tensor]: ...
@overload
def batch_advantages(
    rewards: Sequence[Tensor], scale_rewards: ScaleRewards = ..., eps: float = ..., zero_variance_weight: float = ...
) -> tuple[list[Tensor], Tensor]: ...
def batch_advantages(
    rewards: Tensor | Sequence[Tensor], scale_rewards: ScaleRewards = "group", eps: float = 1e-4,
    zero_variance_weight: float = 0.0,
) -> tuple[Tensor | list[Tensor], Tensor]:
    """Advantages of N groups at once.

    ``rewards`` is either an (N, G) tensor (every group has G completions) or a sequence of N 1-D
    tensors of possibly different sizes. Returns ``(advantages, zero_variance_N)`` where the
    advantages have the input's structure ((N, G) tensor, or a list of N 1-D tensors) and
    ``zero_variance_N`` is a bool (N,) tensor, True for groups whose rewards are all equal (their
    advantages are exact zeros; an empty group counts as zero-variance).

    "batch" scaling divides every group's centred rewards by the unbiased std of *all* rewards of
    the batch (the raw rewards, not the centred ones, as in TRL). ``zero_variance_weight`` λ > 0
    gives zero-variance groups ``λ·(r - batch mean)/(batch std + eps)`` (see the module docstring).
    """
    _check_scale(scale_rewards)
    if not 0.0 <= zero_variance_weight <= 1.0 or zero_variance_weight != zero_variance_weight:
        raise AdvantageError(f"zero_variance_weight={zero_variance_weight!r}: must be in [0, 1]")
    as_matrix = isinstance(rewards, Tensor)
    if as_matrix:
        if rewards.ndim != 2:
            raise AdvantageError(
                f"batch_advantages: rewards tensor must be (N, G), got shape {tuple(rewards.shape)}"
            )
        groups = list(rewards.unbind(0))
    else:
        groups = [torch.as_tensor(g) for g in rewards]
    for i, g in enumerate(groups):
        _check(g, f"batch_advantages: group {i}")

    groups_64 = [g.to(torch.float64) for g in groups]
    flat = torch.cat(groups_64) if groups_64 else torch.zeros(0, dtype=torch.float64)
    batch_std = _std(flat)
    batch_flat = flat.numel() == 0 or bool(flat.max() == flat.min())
    batch_mean = flat.mean() if flat.numel() else flat.new_zeros(())
    advs: list[Tensor] = []
    zero_var: list[bool] = []
    for g, g_64 in zip(groups, groups_64):
        if scale_rewards == "group":
            std = _std(g_64)
        elif scale_rewards == "batch":
            std = batch_std
        else:
            std = None
        adv, zv = _centred_scaled(g_64, std, eps)
        if zv and zero_variance_weight > 0 and g_64.numel() and not batch_flat:
            adv = g_64 - batch_mean  # measured against the batch (module docstring)
            if scale_rewards != "none":
                adv = adv / (batch_std + eps)
            adv = zero_variance_weight * adv
        advs.append(adv.to(_out_dtype(g)))
        zero_var.append(zv)
    zero_var_N = torch.tensor(zero_var, dtype=torch.bool)
    if as_matrix:
        out = torch.stack(advs) if advs else rewards.to(_out_dtype(rewards)).clone()
        return out, zero_var_N
    return advs, zero_var_N
