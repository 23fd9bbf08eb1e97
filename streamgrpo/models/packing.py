"""Shared-prompt packing: each group's prompt once in the forward, its G completions after it.

The G rows of a GRPO group share one prompt (with a video, thousands of tokens) and differ only in
their completions (often tens to hundreds of tokens). The right-padded :class:`TrainBatch` runs the
decoder over the prompt G times; a packed batch lays each group out as one sequence::

    prompt | completion 1 | completion 2 | ... | completion G | pad

and a block attention mask lets completion r see the prompt and its own earlier tokens only, so
every completion token has exactly the context it had in its own row. Positions (m-RoPE) of
completion r continue from the prompt's last position, as in the row layout; the first token of
every completion is predicted from the prompt's last position. Decoder tokens per group fall from
``G * P + sum(C)`` to ``P + sum(C)``.

The mask is a custom 4D one (``(groups, 1, L, L)``, boolean for sdpa, additive for eager), which
transformers passes to the attention as given; ``flash_attention_2`` cannot take it.

:func:`pack_batch` is pure layout (tested on its own); :func:`block_mask` turns segment ids into
the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from streamgrpo.models.batching import BatchError, TrainBatch

PAD_SEGMENT = -1
PROMPT_SEGMENT = 0


@dataclass
class PackedBatch:
    """One row per group of a :class:`TrainBatch`: ``prompt | completions | pad``.

    Shapes (N groups, L the longest packed row): ``input_ids``, ``mm_token_type_ids`` (N, L);
    ``position_ids`` (3, N, L); ``segment_NL``: -1 pad, 0 prompt, r + 1 the group's r-th
    completion; ``logit_pos_BT``: for every row b and completion token t of the TrainBatch, the
    position in row ``row_group[b]`` whose hidden state predicts that token (0 where masked).
    """

    input_ids: Tensor
    position_ids: Tensor
    mm_token_type_ids: Tensor | None
    segment_NL: Tensor
    logit_pos_BT: Tensor
    row_group: Tensor

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens the decoder sees."""
        return int((self.segment_NL != PAD_SEGMENT).sum())


def pack_batch(batch: TrainBatch, pad_token_id: int) -> PackedBatch:
    """Lay out ``batch`` (positions already computed, :func:`~streamgrpo.models.batching.prepare_batch`) per group."""
    if batch.position_ids is None:
        raise BatchError("pack_batch: the batch has no positions yet; prepare_batch(batch, model) first")
    n = len(batch.groups)
    rows_of: list[list[int]] = [[] for _ in range(n)]
    for b, gi in enumerate(batch.row_group.tolist()):
        rows_of[gi].append(b)
    p_lens = [int(g.prompt_ids.numel()) for g in batch.groups]
    c_lens = batch.completion_lens.tolist()
    L = max(p_lens[gi] + sum(c_lens[b] for b in rows_of[gi]) for gi in range(n))
    device = batch.input_ids.device
    input_ids = torch.full((n, L), int(pad_token_id), dtype=torch.long, device=device)
    position_ids = torch.zeros((3, n, L), dtype=torch.long, device=device)
    segment = torch.full((n, L), PAD_SEGMENT, dtype=torch.long, device=device)
    mm_types = None if batch.mm_token_type_ids is None else torch.zeros((n, L), dtype=torch.long, device=device)
    logit_pos = torch.zeros_like(batch.logit_index)
    for gi in range(n):
        P = p_lens[gi]
        rows = rows_of[gi]
        if not rows:
            raise BatchError(f"pack_batch: group {gi} has no rows")
        first = rows[0]  # every row of a group carries the same prompt (ids, positions, types)
        input_ids[gi, :P] = batch.input_ids[first, :P]
        position_ids[:, gi, :P] = batch.position_ids[:, first, :P]
        segment[gi, :P] = PROMPT_SEGMENT
        if mm_types is not None:
            mm_types[gi, :P] = batch.mm_token_type_ids[first, :P]
        at = P
        for r, b in enumerate(rows):
            C = c_lens[b]
            input_ids[gi, at : at + C] = batch.input_ids[b, P : P + C]
            position_ids[:, gi, at : at + C] = batch.position_ids[:, b, P : P + C]
            segment[gi, at : at + C] = r + 1
            if C:
                logit_pos[b, 0] = P - 1
                logit_pos[b, 1:C] = torch.arange(at, at + C - 1, device=device)
            at += C
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, mm_token_type_ids=mm_types,
                       segment_NL=segment, logit_pos_BT=logit_pos, row_group=batch.row_group)


def block_mask(segment_NL: Tensor) -> Tensor:
    """Boolean (N, 1, L, L), True where query q may attend to key k.

    Causal, and a key must be in the prompt or in the query's own completion. A pad query attends
    to itself only (a row with no key would give NaN; its output is never read).
    """
    L = segment_NL.shape[1]
    q = segment_NL[:, :, None]
    k = segment_NL[:, None, :]
    causal = torch.ones((L, L), dtype=torch.bool, device=segment_NL.device).tril()
    allowed = causal & (k != PAD_SEGMENT) & (q != PAD_SEGMENT) & ((k == PROMPT_SEGMENT) | (k == q))
    allowed |= torch.eye(L, dtype=torch.bool, device=segment_NL.device) & (q == PAD_SEGMENT)
    return allowed[:, None]


def attention_mask_for(segment_NL: Tensor, attn_implementation: str | None, dtype: torch.dtype) -> Tensor:
    """The 4D mask in the form the model's attention takes: boolean for sdpa, additive for eager."""
    allowed = block_mask(segment_NL)
    if attn_implementation in (None, "sdpa"):
        return allowed
    if attn_implementation == "eager":
        out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return out.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise BatchError(f"learner.shared_prompt needs attn_implementation sdpa or eager (a custom attention mask); "
                     f"got {attn_implementation!r}")
