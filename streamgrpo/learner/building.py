"""What building a learner's policy needs beside the transformers model: activation checkpointing as configured,
the compile/selective-checkpoint check, and the module DeepSpeed wraps (:class:`PolicyLogprobs`)."""

from __future__ import annotations

import logging

import torch

from streamgrpo.config import ConfigError
from streamgrpo.models.capabilities import inspect_model
from streamgrpo.models.logprobs import completion_logprobs
from streamgrpo.models.selective_checkpoint import checkpoints_inside_forward

log = logging.getLogger("streamgrpo.learner")


def enable_activation_checkpointing(model, every: int = 1, offload: bool = False, matmuls: bool = False) -> None:
    """``learner.gradient_checkpointing``: recompute every ``every``-th layer in backward (non-reentrant),
    with ``offload`` its saved inputs in pinned host memory (``learner.checkpoint_every`` /
    ``checkpoint_offload``: transformers' ``every_n_layers`` / ``offload``, in
    ``activation_checkpointing_enable`` on 5.24 and in ``gradient_checkpointing_enable`` on 5.17:
    :mod:`streamgrpo.models.capabilities` finds which); with ``matmuls`` (``learner.checkpoint_matmuls``)
    the matmul and attention outputs kept, the rest recomputed (:mod:`streamgrpo.models.selective_checkpoint`)."""

    kwargs = {"use_reentrant": False}
    if matmuls:
        from streamgrpo.models.selective_checkpoint import save_matmuls_context_fn

        kwargs["context_fn"] = save_matmuls_context_fn()
    caps = inspect_model(model)  # the class of this module (a LoRA base is not unwrapped here)
    if caps.checkpointing is None:
        if every > 1 or offload:
            raise ConfigError(f"learner.checkpoint_every / checkpoint_offload need a transformers release whose "
                              f"activation (or gradient) checkpointing switch takes every_n_layers and offload "
                              f"(this is {caps.release}; pip install -U transformers), or leave them at 1 / false")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    getattr(model, caps.checkpointing)(**{caps.checkpointing_kwargs: kwargs}, every_n_layers=every, offload=offload)


def refuse_selective_around_compiled_layers(lc) -> None:
    """``learner.checkpoint_matmuls`` with ``learner.compile``: one line on a transformers release that checkpoints
    around the compiled layer (5.17), where the policy would not be traced into the compiled graph."""

    if lc.compile and lc.checkpoint_matmuls and not checkpoints_inside_forward():
        import transformers

        raise ConfigError(f"learner.checkpoint_matmuls with learner.compile needs transformers' checkpointing inside "
                          f"the compiled layer's forward (5.24 and later; this is {transformers.__version__}, which "
                          f"checkpoints around it): upgrade transformers, or set one of them to false")


class PolicyLogprobs(torch.nn.Module):
    """The policy with its forward set to "completion log-probs of a TrainBatch".

    This is the module DeepSpeed wraps, so each micro-batch goes through ``engine(...)`` and gets
    the engine's forward/backward bookkeeping (ZeRO's per-micro-step gradient accumulation hooks).
    """

    def __init__(self, policy: torch.nn.Module, entropy_grad: bool = False, shared_prompt: bool = False,
                 seq_parallel=None):
        super().__init__()
        self.policy = policy
        self.entropy_grad = entropy_grad  # loss.entropy_coef > 0: the entropies carry the gradient
        self.shared_prompt = shared_prompt  # learner.shared_prompt: one copy of each group's prompt
        self.seq_parallel = seq_parallel  # learner.sequence_parallel: models/sp_group.py's SPGroup

    def forward(self, batch, temperature: float = 1.0, suppress_token_ids=None):

        return completion_logprobs(self.policy, batch, temperature=temperature, with_entropy=True,
                                   entropy_grad=self.entropy_grad, suppress_token_ids=suppress_token_ids,
                                   shared_prompt=self.shared_prompt, seq_parallel=self.seq_parallel)


