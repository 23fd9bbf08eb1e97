"""How a sequence-parallel group of N ranks splits one forward's sequences (``learner.sequence_parallel``): pure.

Every sequence of a forward (a row of the row layout, a group of the shared-prompt layout) has the same padded
length ``L``; it is padded on the right to ``N * ceil(L / N)`` and rank r holds the columns ``[r * l, (r + 1) * l)``
(``l = padded / N``) of every sequence: the token ids, the m-RoPE position ids (all 3 axes, or 4 with Qwen3-VL's
text axis: the last dimension is sliced, so a token keeps the position it has in the whole sequence) and the
multimodal token types alike. The padding goes after every real token, so a causal mask (rows) or the block mask of
the packed layout (padding as ``PAD_SEGMENT``) keeps it out of every real token's context.

The vision features of a sequence's placeholder tokens are numbered in the order the model scatters them (sequence
after sequence, left to right): :meth:`SeqSplit.feature_index` says which of them land in rank r's columns.

Log-probs: the hidden state at position p predicts a completion token; rank ``p // l`` owns it
(:meth:`SeqSplit.owner`) and computes its log-prob through the LM head; the ranks' (B, T) tensors, zero where they
do not own the token, are summed over the group, so every rank holds all log-probs and computes the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class SplitError(ValueError):
    """A sequence-parallel split that cannot be made (the message says why)."""


@dataclass(frozen=True)
class SeqSplit:
    """Rank ``rank`` of ``world``'s share of sequences ``length`` tokens long."""

    length: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise SplitError(f"sequence parallel: rank {self.rank} of {self.world}")
        if self.length < 1:
            raise SplitError(f"sequence parallel: a sequence of {self.length} tokens")

    @property
    def chunk(self) -> int:
        """Columns each rank holds."""
        return -(-self.length // self.world)

    @property
    def padded(self) -> int:
        return self.chunk * self.world

    @property
    def start(self) -> int:
        return self.rank * self.chunk

    @property
    def stop(self) -> int:
        return self.start + self.chunk

    def pad(self, x: Tensor, value: float | int = 0) -> Tensor:
        """``x`` (..., length) right-padded with ``value`` to (..., padded)."""
        if x.shape[-1] != self.length:
            raise SplitError(f"sequence parallel: a tensor of {x.shape[-1]} columns for sequences of {self.length}")
        extra = self.padded - self.length
        if not extra:
            return x
        return torch.cat([x, x.new_full((*x.shape[:-1], extra), value)], dim=-1)

    def local(self, x: Tensor, value: float | int = 0) -> Tensor:
        """This rank's columns of ``x`` (..., length), padded with ``value`` where the padding falls in them."""
        return self.pad(x, value)[..., self.start:self.stop]

    def local_positions(self, position_ids: Tensor) -> Tensor:
        """This rank's columns of m-RoPE ``position_ids`` (axes, sequences, length); padding continues each
        axis past its last position (a pad is never in a real token's context: any value would do)."""
        extra = self.padded - self.length
        if extra:
            step = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
            position_ids = torch.cat([position_ids, position_ids[..., -1:] + step], dim=-1)
        return position_ids[..., self.start:self.stop]

    def owner(self, pos: Tensor) -> Tensor:
        """The rank holding each column in ``pos``."""
        return torch.div(pos, self.chunk, rounding_mode="floor")

    def owns(self, pos: Tensor) -> Tensor:
        return (pos >= self.start) & (pos < self.stop)

    def feature_index(self, mask_SL: Tensor) -> tuple[Tensor, Tensor]:
        """``mask_SL`` (sequences, length): True at the tokens that take a vision feature, numbered in row-major
        order. Returns this rank's columns of the mask and the numbers of the features that fall in them, in the
        row-major order of the local columns (what ``masked_scatter`` on the local embeddings takes)."""
        number = torch.cumsum(mask_SL.reshape(-1).long(), 0).reshape(mask_SL.shape) - 1
        local_mask = self.local(mask_SL, False)
        return local_mask, self.local(number, 0)[local_mask]


def split_frames(grids: list[tuple[int, int, int]], world: int) -> list[list[tuple[int, int, int, int]]]:
    """The temporal patches of ``grids`` (one ``(t, h, w)`` per image or video, in order) dealt to ``world`` ranks in
    contiguous runs of about equal patch counts: per rank, ``(item, first t, t count, patches)`` pieces in order.
    A Qwen-VL vision trunk attends within a temporal patch (windows, full-attention blocks, Qwen3-VL's blocks), so
    the pieces run apart and their outputs, concatenated in rank order, are the whole pass's."""
    if world < 1:
        raise SplitError(f"split_frames: {world} ranks")
    frames = [(i, t, h * w) for i, (n, h, w) in enumerate(grids) for t in range(n)]
    total = sum(p for _, _, p in frames)
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world)]
    done = 0
    for i, t, p in frames:
        r = min(world - 1, (done * world + (p * world) // 2) // max(total, 1))  # by the frame's midpoint
        pieces = out[r]
        if pieces and pieces[-1][0] == i and pieces[-1][1] + pieces[-1][2] == t:
            item, first, count, patches = pieces[-1]
            pieces[-1] = (item, first, count + 1, patches + p)
        else:
            pieces.append((i, t, 1, p))
        done += p
    return out
