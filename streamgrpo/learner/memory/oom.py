"""Out of memory in a learner step costs a retry, not the run.

Each phase of a step that can run out of device memory (a micro-batch's forward and loss, its
backward, the optimizer step) runs inside :func:`out_of_memory`. When ``torch.OutOfMemoryError``
escapes the phase on a rank, that rank leaves it; then every rank compares (one all-reduce of three
numbers, before the next phase's collectives) and, when any rank ran out, every rank raises the
same :class:`StepOutOfMemory`: the largest failing micro-batch's tokens and sequences. The learner
(:func:`streamgrpo.learner.intake.poison.guarded_step`) then frees what it can, halves its micro-batch token
budget (:meth:`~streamgrpo.learner.micro_batches.MicroBudget.halve`; whole groups are cut into runs of their completions when one group is
over it, down to one sequence) and trains the same groups again, which stay uncommitted meanwhile;
the next steps keep the smaller budget. When one sequence alone does not fit,
:class:`LearnerOutOfMemory` ends the learner with one line naming what would make it fit.

With ``learner.sequence_parallel`` the ranks of a group exchange attention heads at every decoder layer, in
the forward and in the backward: a rank that runs out between two exchanges first tells its group
(:func:`~streamgrpo.models.sp_group.settle`), whose ranks learn it at their next exchange's gate and leave the
phase too (:class:`~streamgrpo.models.sp_group.PeerOutOfMemory`), so that every rank reaches the agreement
below having made the same collectives; then the retry is the same as without sequence parallelism.

Limit: DeepSpeed runs collectives of its own inside the backward and the optimizer step; with several
data-parallel ranks a rank that runs out *inside* one of those leaves its peers waiting in it (NCCL's timeout
ends them, and the restarted learner trains the step's groups again). Out of memory in the forward, where
activations peak, and anywhere in the torch backend's step, is agreed on safely.
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager

import torch

from streamgrpo import metrics as M
from streamgrpo.learner.distributed import share
from streamgrpo.learner.micro_batches import group_tokens
from streamgrpo.models.sp_group import PeerOutOfMemory, settle

log = logging.getLogger("streamgrpo.learner")

class StepOutOfMemory(Exception):
    """Some rank ran out of memory in this step (the same on every rank): retry with a smaller budget."""

    def __init__(self, tokens: int, rows: int):
        super().__init__(f"out of memory in a micro-batch of {tokens} tokens ({rows} sequences)")
        self.tokens, self.rows = tokens, rows


class LearnerOutOfMemory(RuntimeError):
    """One sequence per micro-batch does not fit: a setting must change (one line, exit 1, no traceback)."""


def one_sequence_message(tokens: int) -> str:
    return (f"out of memory in a learner step with one sequence per micro-batch ({tokens} tokens): make one "
            "sequence fit with learner.gradient_checkpointing: true, a shorter rollout.max_completion_length, a "
            "smaller data.max_pixels or data.max_frames, or optimizer offload (learner.backend: deepspeed with "
            "learner.deepspeed_config: zero2_offload); learner.micro_batch_tokens is "
            "already down to one sequence")


@contextmanager
def out_of_memory(learner, part: list, shared_prompt: bool):
    """Run one phase of a step; every rank raises :class:`StepOutOfMemory` when any ran out in it."""
    failed = peer_failed = False
    try:
        yield
    except torch.OutOfMemoryError:
        failed = True
    except PeerOutOfMemory:  # a rank of this one's sequence-parallel group ran out, and said so at a gate
        peer_failed = True
    if not peer_failed:
        settle(learner.seq_parallel, failed)  # the group's last word in this phase: see streamgrpo.models.sp_group
    tokens = sum(group_tokens(a, shared_prompt) for a in part) if failed else 0
    rows = sum(len(a.group.completions) for a in part) if failed else 0
    agreed = share(learner.dist, [float(failed), tokens, rows]) if learner.dist.world_size > 1 else \
        [[float(failed), tokens, rows]]
    worst = max(agreed, key=lambda r: (r[0], r[1]))
    if worst[0]:
        raise StepOutOfMemory(int(worst[1]), int(worst[2]))


def free_memory(learner) -> None:
    """Drop the failed step's gradients and cached blocks before the retry."""
    learner.discard_gradients()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shrink_after(learner, oom: StepOutOfMemory) -> int:
    """Halve the learner's micro-batch budget after ``oom`` (one warning line, counted); the new budget. Raises
    :class:`LearnerOutOfMemory` when the micro-batch that failed was one sequence."""

    free_memory(learner)
    M.ERRORS.labels(kind="learner_oom").inc()
    budget = learner.budget.halve(oom.tokens, oom.rows)  # a group over it is cut into runs of its rows from now on
    if budget is None:
        raise LearnerOutOfMemory(one_sequence_message(oom.tokens))
    if learner.dist.is_main:
        log.warning("%s: retrying the step with learner.micro_batch_tokens=%d (kept for the next steps)", oom, budget)
    return budget
