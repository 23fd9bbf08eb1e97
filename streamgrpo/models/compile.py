"""``learner.compile``: each decoder layer compiled with ``torch.compile`` (regional compilation).

Why per layer: a Qwen-VL decoder is N copies of one layer; compiling the layer (``nn.Module.compile``) gives
one graph that every layer of the model reuses (dynamo treats a module's parameters as inputs), so a 36-layer
model compiles about as fast as a 2-layer one, and the rest of the step (the vision trunk, the chunked
log-probs, the loss, the optimizer) stays eager. ``nn.Module.compile`` keeps the module and its
``state_dict`` names (no ``_orig_mod.``), and LoRA adapters and activation checkpointing stay inside the layer:
transformers' checkpointing (:class:`~transformers.modeling_layers.GradientCheckpointingLayer`) runs either
inside the compiled call (5.24: ``forward`` is checkpointed, traced as one region that inductor recomputes)
or around it (5.17: ``__call__``, the recompute calls the compiled layer again).

Shapes are compiled dynamic (``dynamic=True``): a step whose sequences are longer or shorter than the last
one reuses the graph instead of recompiling. What still compiles again, once each: the grad mode (the
reference's and the log-prob probes' forwards run under ``no_grad``), a parameter dtype (a bf16 reference
next to a float32 policy) and a LoRA model's adapters switched off (its reference); all in
:func:`compiled_graphs`.

The frozen vision blocks are not compiled: their windowed attention splits the patches by data-dependent
lengths (a graph break per window), and they run once per micro-batch under ``no_grad`` already
(:mod:`streamgrpo.models.vision_trunk`).
"""

from __future__ import annotations

import torch

from streamgrpo.models.batching import unwrap_model

BACKENDS = ("inductor", "aot_eager")
RECOMPILE_LIMIT = 32


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Qwen-VL model (peft, DeepSpeed or DDP wrappers looked through)."""

    return list(unwrap_model(model).model.language_model.layers)


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer of ``model`` in place (``backend``: inductor, or aot_eager: dynamo and
    AOTAutograd without code generation); returns how many. Compiling is lazy: the first forward of each new
    kind (grad mode, dtype) pays it."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown torch.compile backend {backend!r}; expected one of {BACKENDS}")
    import torch._dynamo.config as dynamo_config

    # every layer of every model shares the layer's code, so all its graph variants (grad mode, dtype, eval mode,
    # adapters off, a batch of one row) count against one limit, past which dynamo silently runs the layer eagerly
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def is_compiled(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every model, every recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
