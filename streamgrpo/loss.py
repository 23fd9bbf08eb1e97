r"""The clipped importance-ratio GRPO loss (pure tensor function).

Inputs per completion token t of row b (all (B, T), only positions with ``mask`` set count):
``p`` current log-prob (carries the gradient), ``q`` behaviour log-prob (what the generator
sampled with, possibly several policy versions old), ``r`` reference log-prob; ``A_b`` the
advantage of row b ((B,), from :mod:`streamgrpo.advantages`).

Per-token objective (pessimistic PPO form, Schulman et al. 2017; asymmetric "clip-higher" bounds
from DAPO, Yu et al. 2025)::

    rho_t  = exp(p_t - q_t)                                  ratio_mode="behaviour"
    rho_t  = exp(p_t - sg(p_t))   (value 1, gradient of p)   ratio_mode="current" or "decoupled"
    J_t    = min(rho_t * A_b, clip(rho_t, 1 - epsilon, 1 + epsilon_high) * A_b)
    J_t   *= min(sg(exp(p_t - q_t)), tis_cap)                 when tis_cap is set, or with "decoupled"
                                                             (no cap there when tis_cap is None)
    J_t    = 0 where the IS ratio w = exp(p - q) leaves [lo, hi]  only with is_mask (masked IS, MIS):
             is_mask="token": per token; "sequence": whole rows, by the row's geometric-mean ratio
             exp(mean_t(p_t - q_t)) (the normaliser still counts masked tokens: they add nothing)
    l_t    = -J_t + beta * k3_t,   k3_t = exp(r_t - p_t) - (r_t - p_t) - 1   (k3 only when beta > 0)

``sg`` is stop-gradient. k3 is the unbiased, always non-negative estimator of KL(pi || pi_ref)
from J. Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html), as
used by GRPO. Gradient of J_t: A_b * rho_t * grad p_t unless the ratio is clipped on the side that
matters for the sign of A (A>0 and rho>1+epsilon_high, or A<0 and rho<1-epsilon: zero gradient).
``ratio_mode="current"`` ignores the behaviour policy (plain on-policy policy gradient that ignores
staleness; a baseline for the staleness benchmark). The truncated importance weight always uses the
behaviour log-probs; it is the natural correction to pair with ``ratio_mode="current"`` (truncated
importance-sampled PG), while with ``ratio_mode="behaviour"`` it multiplies the already
importance-weighted PPO term (exactly as the design's section 3 specifies).

``ratio_mode="decoupled"`` is decoupled PPO (AReaL; Fu et al. 2025): the trust region is taken
around a *proximal* policy, and the behaviour policy enters only through the importance weight
pi_prox / pi_behav. The proximal policy here is the learner's own parameters at the step that
trains the group (``sg(p)``): streamgrpo takes one optimizer step per batch, so a recomputed
snapshot of the version current when the group is consumed would give the same log-probs at the
cost of an extra forward pass. The clip then binds only inside a step (it is value 1), and the
correction is the weight exp(sg(p) - q), truncated at ``tis_cap`` when one is set (AReaL's
behaviour-weight cap). With one update per batch this equals ``current`` + ``tis_cap``, written as
the named method the field compares against.

Aggregation of l over tokens (``loss_type``), with M the mask and L = ``max_completion_length``::

    grpo     mean_b( sum_t M l / max(sum_t M, 1) )      per-sequence mean, then batch mean
                                                         (GRPO: DeepSeekMath, Shao et al. 2024)
    bnpo     sum_bt M l / max(sum_bt M, 1)              token mean over this batch
    dr_grpo  sum_bt M l / (B * L)                        constant normaliser (Dr. GRPO, Liu et al. 2025)
    dapo     sum_bt M l / token_normaliser               token-level mean over the *global* batch of the
                                                         optimizer step (DAPO, Yu et al. 2025); the
                                                         normaliser defaults to max(sum_bt M, 1) here

Under gradient accumulation or several ranks pass ``token_normaliser`` = the number of completion
tokens of the whole optimizer step (all micro-batches, all ranks); summing the micro-batch losses
(and the gradients across ranks) then gives exactly the dapo loss of the whole step.

Off-policy health (always, when behaviour log-probs are given): ``ratio_sq_mean`` (mean w^2, so the
effective sample size fraction of the step is ratio_mean^2 / ratio_sq_mean: 1 on-policy, towards 0
as the sample's weight piles on few tokens), ``kl_behaviour`` (mean of (w - 1) - log w, the k3
estimate of KL(behaviour || current) from tokens the behaviour policy sampled) and
``is_masked_frac`` (tokens masked by is_mask).

Masked positions may hold anything (even inf/nan): they are replaced with ``torch.where`` before any
arithmetic, so they reach neither the loss nor the gradient. Arithmetic runs in at least float32.
Metrics come back as detached 0-d tensors (no host sync inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

import torch
from torch import Tensor

if TYPE_CHECKING:
    from streamgrpo.config import LossConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
RatioMode = Literal["behaviour", "current", "decoupled"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
RATIO_MODES: tuple[str, ...] = ("behaviour", "current", "decoupled")

__all__ = [
    "LOSS_TYPES",
    "RATIO_MODES",
    "LossError",
    "LossSpec",
    "LossType",
    "RatioMode",
    "compute_loss",
    "kl_k3",
]


LOG_RATIO_CLAMP = 20.0
"""|log pi - log mu| past which a token's importance ratio is taken at e^+-20: far outside every clip and
mask band, and far inside float32 (a behaviour log-prob of -100 would otherwise overflow exp)."""


@dataclass(frozen=True)
class LossSpec:
    """What :func:`compute_loss` computes, made once from the ``loss`` config section (:meth:`from_config`). The
    defaults are the plain clipped objective's: no KL, no truncation, no masking, no entropy bonus."""

    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: LossType = "dapo"
    max_completion_length: Optional[int] = None  # required by dr_grpo
    tis_cap: Optional[float] = None
    ratio_mode: RatioMode = "behaviour"
    is_mask: Optional[Literal["token", "sequence"]] = None
    is_mask_band: tuple[float, float] = (0.5, 2.0)
    entropy_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg: LossConfig, max_completion_length: Optional[int] = None) -> LossSpec:
        """The spec of a ``loss`` section (and the rollout's ``max_completion_length``, which dr_grpo divides by)."""
        return cls(epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                   max_completion_length=max_completion_length, tis_cap=cfg.tis_cap, ratio_mode=cfg.ratio_mode,
                   is_mask=cfg.is_mask, is_mask_band=(cfg.is_mask_low, cfg.is_mask_high),
                   entropy_coef=cfg.entropy_coef)


PLAIN = LossSpec()
"""The plain clipped objective (no KL, no truncation, no masking): :func:`compute_loss`'s default spec."""


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): ``exp(r - p) - (r - p) - 1`` (>= 0, 0 iff equal).

    Written as ``expm1(d) - d``: exact near d = 0 and never negative in floating point (expm1(d) >= d
    holds exactly and rounding is monotone).
    """
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


class LossError(ValueError):
    """A bad input or option of :func:`compute_loss`. Nothing here counts it: the caller (the learner)
    counts it as ``streamgrpo_errors_total{kind=...}`` with :attr:`kind`."""

    kind = "loss"


def _bad(msg: str) -> LossError:
    return LossError(f"compute_loss: {msg}")


def _check_bt(name: str, x: Tensor, shape: torch.Size) -> None:
    if not isinstance(x, Tensor):
        raise _bad(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise _bad(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (B, T) like logprobs")


def _masked_mean(x: Tensor, m: Tensor, n: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros_like(x)).sum() / n


def compute_loss(
    logprobs: Tensor,
    behaviour_logprobs: Optional[Tensor],
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Optional[Tensor] = None,
    *,
    spec: LossSpec = PLAIN,
    entropies: Optional[Tensor] = None,
    token_normaliser: Union[None, int, float, Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of one (micro-)batch and its metrics; formulas in the module docstring, settings in ``spec``.

    ``spec.entropy_coef`` > 0 subtracts ``entropy_coef`` x each token's policy entropy (``entropies``,
    which must then be given and carry the gradient) before the aggregation, an entropy bonus
    (verl's ``entropy_coeff``).

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``ref_logprobs``, ``mask``, ``entropies`` (B, T);
    ``advantages`` (B,). ``ref_logprobs`` is never read when ``beta == 0`` (it may be None).
    ``max_completion_length`` is required for ``dr_grpo``; ``token_normaliser`` (the global token
    count of the optimizer step) is only accepted for ``dapo``. ``behaviour_logprobs`` may be None
    only with ``ratio_mode="current"``, no ``tis_cap`` and no ``is_mask``.

    Returns ``(loss, metrics)``: a 0-d loss (float32 or wider) and detached 0-d tensors
    ``clip_frac_low`` (A<0, ratio<1-epsilon), ``clip_frac_high`` (A>0, ratio>1+epsilon_high),
    ``clip_frac`` (either), ``ratio_mean/max/min`` (of exp(p - q) when behaviour log-probs are
    given, else of the objective's ratio; 1 with no tokens), ``kl`` (mean k3; 0 when beta == 0),
    ``adv_mean``/``adv_std`` (population std over rows with at least one token), ``entropy`` (only
    when ``entropies`` is given) and ``num_tokens``; token fractions and means are over this call's
    unmasked tokens.
    """
    epsilon, epsilon_high, beta, loss_type = spec.epsilon, spec.epsilon_high, spec.beta, spec.loss_type
    max_completion_length, tis_cap, ratio_mode = spec.max_completion_length, spec.tis_cap, spec.ratio_mode
    is_mask, is_mask_band, entropy_coef = spec.is_mask, spec.is_mask_band, spec.entropy_coef
    _validate(logprobs, behaviour_logprobs, advantages, mask, ref_logprobs, entropies, epsilon=epsilon,
              epsilon_high=epsilon_high, beta=beta, loss_type=loss_type, max_completion_length=max_completion_length,
              tis_cap=tis_cap, token_normaliser=token_normaliser, ratio_mode=ratio_mode, is_mask=is_mask,
              is_mask_band=is_mask_band, entropy_coef=entropy_coef)
    B, T = logprobs.shape
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    m = mask.to(torch.bool)
    zero = logprobs.new_zeros((), dtype=dtype)

    def clean(x: Tensor) -> Tensor:
        """Masked positions -> 0 before any arithmetic (no nan/inf leaks into values or gradients)."""
        return torch.where(m, x.to(dtype), zero)

    p = clean(logprobs)
    A = torch.where(m, advantages.to(dtype)[:, None].expand(B, T), zero)
    # the log importance ratio clamped before any exp (as verl does): a behaviour log-prob anywhere in the
    # wire's range [-1000, 0] then keeps every ratio, loss and gradient finite (e^20 = 4.9e8)
    log_is = None if behaviour_logprobs is None else \
        (p - clean(behaviour_logprobs.detach())).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    # ---- per-token objective
    log_ratio = log_is if ratio_mode == "behaviour" else p - p.detach()
    ratio = torch.exp(log_ratio)
    objective, kept = _objective(ratio, A, log_is, m, epsilon=epsilon, epsilon_high=epsilon_high, tis_cap=tis_cap,
                                 is_mask=is_mask, is_mask_band=is_mask_band, weight=ratio_mode == "decoupled" or tis_cap is not None)
    per_token = -objective
    kl_t = kl_k3(p, clean(ref_logprobs.detach())) if beta > 0 else None
    if kl_t is not None:
        per_token = per_token + beta * kl_t
    if entropy_coef > 0:
        per_token = per_token - entropy_coef * clean(entropies)
    per_token = torch.where(m, per_token, zero)

    # ---- aggregation, then the metrics (detached, 0-d)
    loss = _aggregate(per_token, m, loss_type, max_completion_length, token_normaliser)
    with torch.no_grad():
        metrics = _metrics(m, A, ratio, log_is, kept, kl_t, advantages, entropies, epsilon=epsilon,
                           epsilon_high=epsilon_high)
    return loss, metrics


# ------------------------------------------------------------------------------- validation
def _validate(logprobs: Tensor, behaviour_logprobs: Optional[Tensor], advantages: Tensor, mask: Tensor,
              ref_logprobs: Optional[Tensor], entropies: Optional[Tensor], *, epsilon: float, epsilon_high: float,
              beta: float, loss_type: str, max_completion_length: Optional[int], tis_cap: Optional[float],
              token_normaliser: Union[None, int, float, Tensor], ratio_mode: str, is_mask: Optional[str],
              is_mask_band: tuple[float, float], entropy_coef: float = 0.0) -> None:
    """Cheap shape/option checks only (no host sync on values), in a fixed order: the first problem raises."""
    if loss_type not in LOSS_TYPES:
        raise _bad(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    if ratio_mode not in RATIO_MODES:
        raise _bad(f"ratio_mode={ratio_mode!r}: must be one of {', '.join(RATIO_MODES)}")
    shape = _check_batch(logprobs, advantages, mask)
    _check_behaviour(behaviour_logprobs, shape, ratio_mode=ratio_mode, tis_cap=tis_cap, is_mask=is_mask,
                     is_mask_band=is_mask_band)
    if epsilon < 0 or epsilon_high < 0:
        raise _bad(f"epsilon={epsilon}, epsilon_high={epsilon_high}: must be >= 0")
    if tis_cap is not None and not tis_cap > 0:
        raise _bad(f"tis_cap={tis_cap}: must be > 0 or None")
    if beta < 0:
        raise _bad(f"beta={beta}: must be >= 0")
    if beta > 0:
        if ref_logprobs is None:
            raise _bad(f"beta={beta} > 0 needs ref_logprobs")
        _check_bt("ref_logprobs", ref_logprobs, shape)
    if entropies is not None:
        _check_bt("entropies", entropies, shape)
    if not entropy_coef >= 0:
        raise _bad(f"entropy_coef={entropy_coef}: must be >= 0")
    if entropy_coef > 0 and entropies is None:
        raise _bad(f"entropy_coef={entropy_coef} > 0 needs entropies")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise _bad(f"loss_type='dr_grpo' needs max_completion_length > 0, got {max_completion_length!r}")
    if token_normaliser is not None and loss_type != "dapo":
        raise _bad(f"token_normaliser is only used by loss_type='dapo', got loss_type={loss_type!r}")


def _check_batch(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> torch.Size:
    """``logprobs`` and ``mask`` (B, T), ``advantages`` (B,); returns (B, T)."""
    if not isinstance(logprobs, Tensor) or logprobs.ndim != 2:
        raise _bad(
            f"logprobs must be a (B, T) tensor, got {getattr(logprobs, 'shape', type(logprobs).__name__)}"
        )
    shape = logprobs.shape
    B, T = shape
    _check_bt("mask", mask, shape)
    if not isinstance(advantages, Tensor) or advantages.shape != (B,):
        raise _bad(
            f"advantages must have shape ({B},) (one per row), got {getattr(advantages, 'shape', advantages)}"
        )
    return shape


def _check_behaviour(behaviour_logprobs: Optional[Tensor], shape: torch.Size, *, ratio_mode: str,
                     tis_cap: Optional[float], is_mask: Optional[str], is_mask_band: tuple[float, float]) -> None:
    """The masked-IS options, and behaviour log-probs wherever the ratio, ``tis_cap`` or ``is_mask`` needs them."""
    if is_mask not in (None, "token", "sequence"):
        raise _bad(f"is_mask={is_mask!r}: must be None, 'token' or 'sequence'")
    if is_mask is not None and not 0 <= is_mask_band[0] < 1 < is_mask_band[1]:
        raise _bad(f"is_mask_band={tuple(is_mask_band)}: needs 0 <= low < 1 < high")
    need_behaviour = ratio_mode != "current" or tis_cap is not None or is_mask is not None
    if behaviour_logprobs is None:
        if need_behaviour:
            raise _bad(f"behaviour_logprobs is None but ratio_mode={ratio_mode!r}, tis_cap or is_mask needs it")
    else:
        _check_bt("behaviour_logprobs", behaviour_logprobs, shape)


# ------------------------------------------------------------------------------- the steps
def _objective(ratio: Tensor, A: Tensor, log_is: Optional[Tensor], m: Tensor, *, epsilon: float,
               epsilon_high: float, tis_cap: Optional[float], is_mask: Optional[str],
               is_mask_band: tuple[float, float], weight: bool) -> tuple[Tensor, Tensor]:
    """J_t (pessimistic clipped PPO term, times the importance weight exp(sg(p) - q) when ``weight``,
    truncated at ``tis_cap`` when set; zero where masked IS drops the token) and the mask of the tokens
    it keeps."""
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    objective = torch.minimum(ratio * A, clipped * A)
    if weight:
        w = torch.exp(log_is.detach().clamp(max=80.0))  # finite (inf x a zero advantage would be nan)
        objective = objective * (w if tis_cap is None else torch.clamp(w, max=tis_cap))
    kept = m
    if is_mask is not None:
        lo, hi = is_mask_band
        w = log_is.detach()
        if is_mask == "sequence":  # the row's geometric-mean ratio, broadcast over its tokens
            w = (w.sum(-1) / m.sum(-1).to(w.dtype).clamp(min=1.0))[:, None].expand(*m.shape)
        kept = m & (w >= (math.log(lo) if lo > 0 else -math.inf)) & (w <= math.log(hi))
        objective = torch.where(kept, objective, objective.new_zeros(()))
    return objective, kept


def _aggregate(per_token: Tensor, m: Tensor, loss_type: str, max_completion_length: Optional[int],
               token_normaliser: Union[None, int, float, Tensor]) -> Tensor:
    """The 0-d loss from the per-token losses (``loss_type``, see the module docstring)."""
    B = m.shape[0]
    dtype = per_token.dtype
    n_safe = m.sum().to(dtype).clamp(min=1.0)
    if loss_type == "grpo":
        per_row = per_token.sum(-1) / m.sum(-1).to(dtype).clamp(min=1.0)
        return per_row.mean() if B > 0 else per_token.sum()
    if loss_type == "bnpo":
        return per_token.sum() / n_safe
    if loss_type == "dr_grpo":
        return per_token.sum() / float(max(B, 1) * max_completion_length)
    norm = (  # dapo
        n_safe
        if token_normaliser is None
        else torch.as_tensor(token_normaliser, dtype=dtype, device=per_token.device)
    )
    return per_token.sum() / norm


def _metrics(m: Tensor, A: Tensor, ratio: Tensor, log_is: Optional[Tensor], kept: Tensor, kl_t: Optional[Tensor],
             advantages: Tensor, entropies: Optional[Tensor], *, epsilon: float,
             epsilon_high: float) -> dict[str, Tensor]:
    """The metrics of :func:`compute_loss` (call under ``torch.no_grad()``)."""
    dtype = A.dtype
    zero = A.new_zeros(())
    one = zero + 1.0
    n_tokens = m.sum().to(dtype)
    n_safe = n_tokens.clamp(min=1.0)
    low = m & (A < 0) & (ratio < 1.0 - epsilon)
    high = m & (A > 0) & (ratio > 1.0 + epsilon_high)
    stat_ratio = torch.exp(log_is) if log_is is not None else ratio
    has_tokens = n_tokens > 0
    inf = torch.full_like(stat_ratio, float("inf"))
    metrics: dict[str, Tensor] = {
        "clip_frac_low": low.sum().to(dtype) / n_safe,
        "clip_frac_high": high.sum().to(dtype) / n_safe,
        "clip_frac": (low | high).sum().to(dtype) / n_safe,
        "ratio_mean": torch.where(has_tokens, _masked_mean(stat_ratio, m, n_safe), one),
        "ratio_max": torch.where(
            has_tokens, torch.where(m, stat_ratio, -inf).amax() if m.numel() else one, one
        ),
        "ratio_min": torch.where(
            has_tokens, torch.where(m, stat_ratio, inf).amin() if m.numel() else one, one
        ),
        "kl": _masked_mean(kl_t, m, n_safe) if kl_t is not None else zero.clone(),
    }
    rows = m.any(-1)
    n_rows = rows.sum().to(dtype).clamp(min=1.0)
    adv = torch.where(rows, advantages.detach().to(dtype), zero)
    adv_mean = adv.sum() / n_rows
    adv_var = torch.where(rows, (adv - adv_mean) ** 2, zero).sum() / n_rows
    metrics["adv_mean"] = adv_mean
    metrics["adv_std"] = adv_var.sqrt()
    if entropies is not None:
        metrics["entropy"] = _masked_mean(entropies.detach().to(dtype), m, n_safe)
    if log_is is not None:
        w_t = torch.exp(log_is)
        metrics["ratio_sq_mean"] = torch.where(has_tokens, _masked_mean(w_t * w_t, m, n_safe), one)
        metrics["kl_behaviour"] = _masked_mean(torch.expm1(log_is) - log_is, m, n_safe)
    metrics["is_masked_frac"] = (m & ~kept).sum().to(dtype) / n_safe
    metrics["num_tokens"] = n_tokens
    return metrics
