"""``learner.checkpoint_matmuls``: selective activation checkpointing (torch's own SAC).

Plain activation checkpointing keeps a recomputed layer's input and runs its whole forward again in
backward: every projection's matmul twice. With this policy the layer's forward keeps what its matmuls
and its attention return (:data:`SAVED_OPS`), and the backward's recompute replays only the cheap
elementwise ops (norms, rotary embedding, SiLU gate, residual adds) around them: one matmul per Linear
and one attention a layer fewer per step, for the kept outputs' memory (per token and recomputed layer
``4 H + 2 K + 2 I`` values: q, attention, o and down, k and v (``K``: key-value heads x head dim), gate
and up; the memory plan counts it,
:mod:`streamgrpo.learner.memory.step`).

Eagerly, :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` caches those ops' outputs in
the forward and hands them back in the recompute; under ``learner.compile`` dynamo records the policy on
the checkpointed region and AOTAutograd's partitioner saves the tagged outputs instead of recomputing them
(inductor still fuses the recomputed elementwise ops into the backward's kernels). The policy is passed to
transformers' checkpointing as the ``context_fn`` of ``torch.utils.checkpoint.checkpoint``
(non-reentrant), through the kwargs of ``activation_checkpointing_enable`` (5.24) or
``gradient_checkpointing_enable`` (5.17).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVED_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                "_efficient_attention_forward")


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in _SAVED_NAMES if hasattr(aten, n))


SAVED_OPS = _saved_ops()
"""The aten ops whose outputs a recomputed layer keeps: matmuls (a Linear is ``mm``/``addmm``) and the fused
attention kernels (those this torch build has)."""


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_context_fn():
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (a partial: dynamo takes it as a constant)."""
    return functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)


def checkpoints_inside_forward() -> bool:
    """Whether transformers checkpoints a layer's ``forward`` (5.24: under ``learner.compile`` the checkpoint, and
    so the policy, is traced into the compiled layer) rather than its ``__call__`` (5.17: the checkpoint runs
    around the compiled layer, and the policy's dispatch modes would keep dynamo from running it compiled)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" not in GradientCheckpointingLayer.__dict__
