"""``model.fp32_lm_head``: the last projection (hidden states -> vocabulary logits) in float32.

A bf16 model computes its logits in bf16: with ~152k vocabulary entries each rounded to 8 bits of
mantissa, a token's log-softmax moves by up to a few 1e-3 between two bf16 kernels (the generator's
engine and the learner's autocast). Both roles calling the same float32 projection removes that
part of the generator = learner gap (MiniMax-M1 and PipelineRL keep the LM head in fp32 for this
reason). The weight stays as it is (its dtype, its name, its place in checkpoints and the weight
channel); the forward casts it and the hidden states up and runs outside autocast. Cost: a float32
copy of the weight while it runs (vocabulary x hidden x 4 bytes, 1.2 GiB at the 3B shape) and a
float32 matmul over the positions the projection sees (the learner's chunks of completion tokens,
one position per decoding step for the HF engine).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def _fp32_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def use_fp32_head(model: nn.Module) -> bool:
    """Make ``model``'s output projection compute in float32 (in place; names and parameters unchanged).
    False when the model has no plain linear output projection (nothing changed)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return False
    head.forward = types.MethodType(_fp32_forward, head)
    return True
