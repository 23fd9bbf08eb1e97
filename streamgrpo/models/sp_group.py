"""A sequence-parallel group of learner ranks (``learner.sequence_parallel: N``), and the word its ranks pass before
every exchange so that out of memory on one of them is a retry, not a hang.

The ranks of a group exchange tensors many times inside one phase of a step: two all-to-alls per decoder layer in
the forward (and in the backward, and again in a checkpointed layer's recompute), the vision features' all-gather,
the log-probs' all-reduce, the torch backend's gradient average. A rank that runs out of memory leaves the phase
between two of them; its peers would wait in the next one until the process group's timeout.

So every such collective is preceded by :func:`gate`: a one-number all-reduce on the host (a gloo group of the same
ranks: no device synchronisation) after the collective's buffers are allocated and before it starts. A rank that
ran out calls :func:`settle` with ``failed`` once instead; a rank that ends the phase normally calls it with
``failed`` false. The settle of a rank that ran out meets either a peer's next gate, which then raises
:class:`PeerOutOfMemory` (the peer leaves the phase too, without a settle of its own), or a peer's settle at the end
of the phase: every rank of the group has then made the same number of collectives, and the learner's agreement
over all ranks (:func:`streamgrpo.learner.memory.oom.out_of_memory`) sees the failure and retries the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group: ``world`` consecutive ranks, this one ``rank`` among them."""

    world: int = 1
    rank: int = 0
    group: Any = None
    """The ``torch.distributed`` process group of the exchanges (None: the default group)."""
    flags: Any = None
    """A gloo process group of the same ranks for :func:`gate` and :func:`settle` (None: no gates)."""

    @property
    def active(self) -> bool:
        return self.world > 1


class PeerOutOfMemory(RuntimeError):
    """Another rank of this sequence-parallel group ran out of memory in this phase: this rank leaves it too."""


def new_groups(world_size: int, rank: int, size: int) -> SPGroup:
    """The groups ``[0, size), [size, 2 size), ...`` of ``world_size`` ranks (every rank calls it, collectively);
    this rank's."""
    if size <= 1:
        return SPGroup()
    if world_size % size:
        raise ValueError(f"learner.sequence_parallel={size} does not divide the {world_size} learner ranks")
    host_side = dist.get_backend() == "gloo"  # the exchanges' own groups already run on the host
    mine = flags = None
    for first in range(0, world_size, size):
        ranks = list(range(first, first + size))
        g = dist.new_group(ranks)  # its own communicator, also for all the ranks: DeepSpeed's keep their order
        f = g if host_side else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine, flags = g, f
    return SPGroup(world=size, rank=rank % size, group=mine, flags=flags)


def _any_failed(sp: SPGroup, failed: bool) -> bool:
    word = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(word, group=sp.flags)
    return bool(word.item())


def gate(sp: SPGroup) -> None:
    """Before a collective of the group, its buffers allocated: raises :class:`PeerOutOfMemory` when a rank of the
    group ran out of memory since the last gate."""
    if sp.active and sp.flags is not None and _any_failed(sp, False):
        raise PeerOutOfMemory("another rank of the sequence-parallel group ran out of memory")


def settle(sp: SPGroup, failed: bool) -> None:
    """The end of a phase on a rank that did not leave it by :class:`PeerOutOfMemory`: ``failed`` (it ran out of
    memory) tells the peers (who learns what: the learner's agreement over all ranks)."""
    if sp.active and sp.flags is not None:
        _any_failed(sp, failed)
