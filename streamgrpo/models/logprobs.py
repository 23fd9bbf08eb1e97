"""Per-token log-probabilities of sampled completions under a Qwen-VL policy (or its reference).

``completion_logprobs(model, batch, temperature=T)`` returns, for every completion token of a
:class:`~streamgrpo.models.batching.TrainBatch`, ``log_softmax(logits / T)`` at the sampled token,
in the (B, T) layout of ``batch.completion_mask`` (0 where masked), as float32. It is the same
quantity a sampler reports at temperature T with top-k/top-p off, so importance ratios against
the behaviour log-probs are exact. The reference path is this same function: a frozen copy of
the model, or a peft model inside ``with model.disable_adapter():``.

How it stays cheap:

* One vision pass per group (``shared_vision=True``). The G rows of a group share one prompt and
  its visuals, so the vision encoder runs once per group (all groups of the batch in one call);
  its outputs (and Qwen3-VL's deepstack features), one reference per row, reach the decoder by
  the path the installed transformers release allows (:mod:`streamgrpo.models.vision_inputs`):
  as precomputed ``mm_encoder_outputs`` where the forward takes them (5.24), else scattered into
  ``inputs_embeds`` by streamgrpo (5.17; :mod:`streamgrpo.models.capabilities` checks which, and
  never passes a keyword the forward does not name). Gradients of the G rows accumulate into the
  single encoder output. ``shared_vision=False`` is the usual per-row path (pixels repeated G
  times, as TRL does).
* Explicit m-RoPE ``position_ids`` from :func:`~streamgrpo.models.batching.build_batch`.
* Optionally each group's prompt once (``shared_prompt=True``, ``learner.shared_prompt``): one
  sequence per group, its completions after the prompt behind a block attention mask
  (:mod:`streamgrpo.models.packing`); the decoder sees ``P + sum(C)`` tokens per group instead of
  ``G * P + sum(C)``. ``shared_vision`` is then implied.
* Only completion positions reach the LM head: the last hidden states are gathered at the
  positions that predict completion tokens (no padding, no prompt), then projected in chunks of
  ``chunk_tokens`` rows; each chunk takes ``logsumexp`` in float32 and gathers the chosen logit.
  With gradients on, each chunk is recomputed in backward (activation checkpointing), so neither
  a float32 (B, T, V) log-softmax nor the (N, V) logits are ever held for the backward pass.

Entropies (``with_entropy=True``) are of the same temperature-scaled distribution; they carry no
gradient (a metric) unless ``entropy_grad=True`` (the loss's entropy bonus).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from streamgrpo.models.batching import GroupInputs, TrainBatch, prepare_batch, unwrap_model  # noqa: F401 - unwrap_model is part of this module's API
from streamgrpo.models.capabilities import capabilities
from streamgrpo.models.packing import PackedBatch, attention_mask_for, pack_batch
from streamgrpo.models.ulysses import hidden_states, kernel_of, sum_over_group
from streamgrpo.models.vision_inputs import decoder_hidden_states

CHUNK_TOKENS = 1024
"""Rows of logits the LM head computes at a time."""

BF16_LOGPROB_TOL = 0.1
"""Largest per-token |log-prob| difference between two bfloat16 computations of one policy (the learner's
autocast vs the sampler's bf16 weights, shared-vision vs per-row, bf16 vs fp32) that the clipped
objective lives with. A log-prob error d moves an importance ratio by the factor e^d; e^0.1 = 1.105 and
e^-0.1 = 0.905 use less than half of the default clip band ([1 - epsilon, 1 + epsilon_high] = [0.8, 1.28],
in logs [-0.223, +0.247]): precision alone never clips an on-policy token. See docs/gpu.md."""
BF16_LOGPROB_MEAN_TOL = 0.03
"""Mean |log-prob| difference over the tokens of a batch: on-policy ratios stay within 3% of 1 on
average (0.15 epsilon), so the objective's scale and ``ess`` barely move."""


def last_hidden_states(model: Any, batch: TrainBatch, *, shared_vision: bool = True) -> Tensor:
    """Final (normed) hidden states (B, L, H) of the language model for ``batch``."""
    hf = unwrap_model(model)
    prepare_batch(batch, hf)
    kw: dict[str, Any] = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    if batch.mm_token_type_ids is not None:
        kw["mm_token_type_ids"] = batch.mm_token_type_ids
    return decoder_hidden_states(hf.model, capabilities(hf), batch, kw, shared_vision=shared_vision)


def packed_hidden_states(model: Any, batch: TrainBatch) -> tuple[Tensor, PackedBatch]:
    """Final hidden states (N groups, L, H) of the shared-prompt layout, and that layout."""
    hf = unwrap_model(model)
    prepare_batch(batch, hf)
    inner = hf.model
    padded = batch.input_ids[batch.attention_mask == 0]
    packed = pack_batch(batch, int(padded[0]) if padded.numel() else 0)  # the batch's pad id (masked anyway)
    attn = getattr(hf.config, "_attn_implementation", None)
    text_cfg = getattr(hf.config, "text_config", None)
    attn = kernel_of(getattr(text_cfg, "_attn_implementation", None) or attn)  # learner.sequence_parallel wraps it
    dtype = next(hf.parameters()).dtype
    kw: dict[str, Any] = dict(
        input_ids=packed.input_ids,
        attention_mask=attention_mask_for(packed.segment_NL, attn, dtype),
        position_ids=packed.position_ids,
        use_cache=False,
    )
    if packed.mm_token_type_ids is not None:
        kw["mm_token_type_ids"] = packed.mm_token_type_ids
    hidden = decoder_hidden_states(inner, capabilities(hf), batch, kw, seq_groups=range(len(batch.groups)))
    return hidden, packed


# ------------------------------------------------------------------------------------ LM head
def _token_logprobs(hidden_NH: Tensor, ids_N: Tensor, lm_head: nn.Module, temperature: float,
                    suppress: Tensor | None, with_entropy: bool, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """log_softmax(lm_head(h) / T)[id] for N positions (float32); entropy with gradient only if ``entropy_grad``."""
    logits = lm_head(hidden_NH).float()
    if temperature != 1.0:
        logits = logits / temperature
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    lse_N = torch.logsumexp(logits, dim=-1)
    logp_N = logits.gather(-1, ids_N[:, None]).squeeze(-1) - lse_N
    ent_N = None
    if with_entropy and entropy_grad and torch.is_grad_enabled():
        # -sum p log p with suppressed (-inf) tokens taken out before any arithmetic: entr's
        # gradient at p = 0 is inf, and inf x 0 would make the whole gradient nan
        logp_NV = logits - lse_N[:, None]
        finite = torch.isfinite(logp_NV)
        logp_NV = torch.where(finite, logp_NV, 0.0)
        ent_N = -(torch.where(finite, logp_NV.exp(), 0.0) * logp_NV).sum(-1)
    elif with_entropy:
        with torch.no_grad():  # the metric: one cheap pass (entr(0) = 0)
            ent_N = torch.special.entr(torch.exp(logits - lse_N[:, None])).sum(-1)
    return logp_N, ent_N


def chunked_token_logprobs(
    hidden_NH: Tensor,
    ids_N: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float = 1.0,
    suppress_token_ids: Sequence[int] | Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
    recompute: bool = True,
    min_chunks: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N,) of ``ids_N`` given hidden states (N, H), ``chunk_tokens`` rows of logits at a time.

    With gradients on and ``recompute``, each chunk's logits are recomputed in backward instead
    of stored. ``suppress_token_ids`` get -inf logits first (as a sampler's ``suppress_tokens``).
    ``min_chunks``: call ``lm_head`` at least this many times, the extra calls over no rows (joined to the
    result, so their backward runs too): DeepSpeed ZeRO-3 gathers the head's weight at every call, collectively,
    so every rank must make as many (:func:`head_chunks`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    suppress = None
    if suppress_token_ids is not None and len(suppress_token_ids):
        suppress = torch.as_tensor(suppress_token_ids, dtype=torch.long, device=hidden_NH.device)
    n = hidden_NH.shape[0]
    spans = [(s, min(s + chunk_tokens, n)) for s in range(0, n, chunk_tokens)]
    spans += [(n, n)] * (min_chunks - len(spans))  # over no rows
    if not spans:
        empty = hidden_NH.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    use_ckpt = recompute and torch.is_grad_enabled() and hidden_NH.requires_grad
    lps, ents = [], []
    for a, b in spans:
        args = (hidden_NH[a:b], ids_N[a:b], lm_head, temperature, suppress, with_entropy, entropy_grad)
        lp, ent = checkpoint(_token_logprobs, *args, use_reentrant=False) if use_ckpt else _token_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def head_chunks(tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """The LM head's calls for ``tokens`` completion tokens (:func:`chunked_token_logprobs`)."""
    return -(-tokens // chunk_tokens)


def completion_logprobs(
    model: Any,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    shared_vision: bool = True,
    suppress_token_ids: Sequence[int] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    recompute: bool = True,
    shared_prompt: bool = False,
    seq_parallel: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies, with gradient if ``entropy_grad``) of the completion tokens of ``batch``.

    Returns ``(logprobs_BT, entropy_BT or None)``, float32, shaped like ``batch.completion_mask``
    and zero where it is False. ``batch`` must be on the model's device (``batch.to(device)``); its
    groups are validated and its positions computed on first use (:func:`prepare_batch`).
    Pass ``suppress_token_ids`` (e.g. :func:`~streamgrpo.models.batching.vision_token_ids`) when
    the sampler suppressed those tokens and reported log-probs of its processed distribution.
    ``shared_prompt``: the packed layout (:func:`packed_hidden_states`); the same values to rounding.
    ``seq_parallel``: a :class:`~streamgrpo.models.ulysses.SPGroup` of several ranks holding the same ``batch``:
    each runs the decoder over its columns and the LM head over the tokens they predict; every rank gets all the
    log-probs (:mod:`streamgrpo.models.ulysses`).
    """
    hf = unwrap_model(model)
    rows, cols = batch.completion_mask.nonzero(as_tuple=True)
    if seq_parallel is not None and seq_parallel.active:
        return _sequence_parallel_logprobs(hf, batch, rows, cols, seq_parallel, shared_prompt=shared_prompt,
                                           temperature=temperature, suppress_token_ids=suppress_token_ids,
                                           with_entropy=with_entropy, entropy_grad=entropy_grad,
                                           chunk_tokens=chunk_tokens, recompute=recompute)
    if shared_prompt:
        hidden_GLH, packed = packed_hidden_states(hf, batch)
        hidden_NH = hidden_GLH[batch.row_group[rows], packed.logit_pos_BT[rows, cols]]
    else:
        hidden_BLH = last_hidden_states(hf, batch, shared_vision=shared_vision)
        hidden_NH = hidden_BLH[rows, batch.logit_index[rows, cols]]
    ids_N = batch.completion_ids[rows, cols]
    _check_vocab(hf, ids_N)
    logp_N, ent_N = chunked_token_logprobs(
        hidden_NH, ids_N, hf.lm_head, temperature=temperature, suppress_token_ids=suppress_token_ids,
        with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_tokens=chunk_tokens, recompute=recompute,
        min_chunks=batch.head_chunks,
    )
    shape = tuple(batch.completion_mask.shape)
    logprobs_BT = logp_N.new_zeros(shape)
    logprobs_BT[rows, cols] = logp_N
    entropy_BT = None
    if with_entropy:
        entropy_BT = logp_N.new_zeros(shape)
        entropy_BT[rows, cols] = ent_N
    return logprobs_BT, entropy_BT


def _check_vocab(hf: nn.Module, ids_N: Tensor) -> None:
    vocab = hf.lm_head.out_features if isinstance(hf.lm_head, nn.Linear) else None
    if ids_N.numel() and (int(ids_N.min()) < 0 or (vocab is not None and int(ids_N.max()) >= vocab)):
        raise ValueError(f"completion token ids outside the vocabulary [0, {vocab})")


def _sequence_parallel_logprobs(hf: nn.Module, batch: TrainBatch, rows: Tensor, cols: Tensor, sp: Any, *,
                                shared_prompt: bool, **head: Any) -> tuple[Tensor, Tensor | None]:
    """:func:`completion_logprobs` over a sequence-parallel group: this rank's columns through the decoder, the
    LM head on the completion tokens they predict, the (B, T) results summed over the group."""

    hidden_SlH, split, packed = hidden_states(hf, batch, sp, shared_prompt=shared_prompt)
    if packed is not None:
        seq, pos = batch.row_group[rows], packed.logit_pos_BT[rows, cols]
    else:
        seq, pos = rows, batch.logit_index[rows, cols]
    ids_N = batch.completion_ids[rows, cols]
    _check_vocab(hf, ids_N)
    mine = split.owns(pos)
    logp_M, ent_M = chunked_token_logprobs(hidden_SlH[seq[mine], pos[mine] - split.start], ids_N[mine], hf.lm_head,
                                           min_chunks=batch.head_chunks, **head)
    shape = tuple(batch.completion_mask.shape)
    # every rank's backward must run through its whole decoder (the exchanges are collectives), also a rank
    # whose columns predict no completion token: its hidden states join the graph with weight 0, and so does the
    # LM head where it computed nothing (every trained tensor gets a gradient on every rank: the reductions of
    # DeepSpeed and of the torch backend's ranks are over the same tensors everywhere). Under ZeRO-3 the head
    # already ran ``batch.head_chunks`` times on every rank (over no rows where its columns predict nothing).
    anchor: Tensor | float = 0.0
    if torch.is_grad_enabled() and hidden_SlH.requires_grad:
        anchor = hidden_SlH.sum() * 0.0
        if not bool(mine.any()) and not batch.head_chunks:  # the head's forward over no rows
            anchor = anchor + hf.lm_head(hidden_SlH.reshape(-1, hidden_SlH.shape[-1])[:0]).sum() * 0.0
    logprobs_BT = logp_M.new_zeros(shape)
    logprobs_BT[rows[mine], cols[mine]] = logp_M
    logprobs_BT = sum_over_group(logprobs_BT + anchor, sp)
    entropy_BT = None
    if ent_M is not None:
        entropy_BT = ent_M.new_zeros(shape)
        entropy_BT[rows[mine], cols[mine]] = ent_M
        entropy_BT = sum_over_group(entropy_BT + (anchor if ent_M.requires_grad else 0.0), sp)
    return logprobs_BT, entropy_BT


def per_row_logprobs(model: Any, batch: TrainBatch, *, temperature: float = 1.0,
                     suppress_token_ids: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """Reference: one plain forward per row (its own vision pass, full logits, ``log_softmax``).

    Slow and memory-hungry on purpose; for tests and benchmarks. Returns ``(logprobs_BT, entropy_BT)``.
    """
    prepare_batch(batch, unwrap_model(model))
    B, T = batch.completion_mask.shape
    out_lp, out_ent = [], []
    for b in range(B):
        g: GroupInputs = batch.groups[int(batch.row_group[b])]
        P, C = int(batch.prompt_lens[b]), int(batch.completion_lens[b])
        n = P + C
        kw = dict(g.visual_kwargs())
        if batch.mm_token_type_ids is not None:
            kw["mm_token_type_ids"] = batch.mm_token_type_ids[b : b + 1, :n]
        logits = model(
            input_ids=batch.input_ids[b : b + 1, :n],
            attention_mask=batch.attention_mask[b : b + 1, :n],
            position_ids=batch.position_ids[:, b : b + 1, :n],
            use_cache=False,
            **kw,
        ).logits[0].float() / temperature
        if suppress_token_ids:
            logits[:, list(suppress_token_ids)] = float("-inf")
        logp = torch.log_softmax(logits[P - 1 : n - 1], dim=-1)
        lp = logp.gather(-1, batch.input_ids[b, P:n, None]).squeeze(-1)
        ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).detach()
        out_lp.append(torch.nn.functional.pad(lp, (0, T - C)))
        out_ent.append(torch.nn.functional.pad(ent, (0, T - C)))
    return torch.stack(out_lp), torch.stack(out_ent)
