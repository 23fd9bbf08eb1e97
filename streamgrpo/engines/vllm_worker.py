"""What runs inside vLLM's worker process: the weight-update extension and the weight-name mapping.

:class:`StreamGRPOWorkerExtension` is mixed into vLLM's worker class by naming it in
``LLM(worker_extension_cls="streamgrpo.engines.vllm_worker.StreamGRPOWorkerExtension")`` (vLLM's
``ParallelConfig.worker_extension_cls``); its methods are then called by name with
``LLM.collective_rpc("streamgrpo_...", args=...)``. Calling by name sends only strings, lists and
tensors over vLLM's msgpack channel (tensors have a native encoding there), so no function has to be
pickled and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. This is the pattern of vLLM's own RLHF
examples (``examples/offline_inference/rlhf_utils.py``: a ``WorkerExtension`` whose methods load
received tensors with ``self.model_runner.model.load_weights``).

Weights are loaded with the model runner's ``reload_weights(weights_iterator=...)``
(vllm/model_executor/model_loader/reload/inplace.py): a plain ``model.load_weights`` is not enough
where the loaded weights are post-processed after loading (the CPU build prepacks linear weights,
quantised layers repack), and ``reload_weights`` re-runs that processing layer by layer and resets
the worker's encoder and multimodal caches.

The name mapping is pure (no vLLM, no torch): :func:`vllm_param_name` maps a learner parameter name
(transformers 5.x ``model.language_model.*``/``model.visual.*``/``lm_head.*``, or the older
checkpoint names) to the vLLM parameter it lands in, following the ``hf_to_vllm_mapper`` and the
stacked-parameter tables of vLLM's ``qwen2_5_vl.py`` / ``qwen3_vl.py`` / ``qwen2.py``. The engine
uses it to refuse, before sending anything, a weight the running model has no parameter for.
"""

from __future__ import annotations

from collections.abc import Iterable

ARCHS = ("qwen2_5_vl", "qwen3_vl")

# Wrapper prefixes a training framework may put in front of a parameter name.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
WRAPPER_INFIXES = ("._checkpoint_wrapped_module", "._orig_mod", "._fsdp_wrapped_module")

# vLLM's hf_to_vllm_mapper (orig_to_new_prefix), first match wins.
_PREFIX_MAP: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.", "language_model.model."),
        ("visual.", "visual."),
    ),
    "qwen3_vl": (
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.language_model.", "language_model.model."),
        ("visual.", "visual."),
    ),
}
# Stacked (fused) parameters: checkpoint sub-name -> vLLM sub-name, shard id.
_TEXT_STACKED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)
_VISION_STACKED: dict[str, tuple[tuple[str, str, object], ...]] = {
    # Qwen2.5-VL's vision MLP is gated (gate/up fused in vLLM); its attention qkv is fused in both.
    "qwen2_5_vl": ((".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1)),
    "qwen3_vl": (),
}


class WeightNameError(KeyError):
    """A weight name the rollout model has no parameter for (the message names it)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def normalize_name(name: str) -> str:
    """Strip training-wrapper prefixes/infixes (DDP ``module.``, ``torch.compile``'s ``_orig_mod.``,
    activation-checkpoint and FSDP wrappers, PEFT's ``base_model.model.`` / ``.base_layer``)."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    for infix in WRAPPER_INFIXES + (".base_layer",):
        name = name.replace(infix, "")
    return name


def vllm_param_name(name: str, arch: str) -> tuple[str, object | None]:
    """The vLLM parameter (and shard id, or None) that the learner weight ``name`` is loaded into.

    >>> vllm_param_name("model.language_model.layers.0.self_attn.k_proj.weight", "qwen2_5_vl")
    ('language_model.model.layers.0.self_attn.qkv_proj.weight', 'k')
    """
    if arch not in _PREFIX_MAP:
        raise ValueError(f"vllm_param_name: unknown arch {arch!r} (expected one of {ARCHS})")
    name = normalize_name(name)
    for old, new in _PREFIX_MAP[arch]:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    else:
        raise WeightNameError(f"weight {name!r}: not a {arch} language-model, vision or lm_head parameter")
    table = _VISION_STACKED[arch] if name.startswith("visual.") else _TEXT_STACKED
    for old, new, shard in table:
        if old in name:
            return name.replace(old, new), shard
    return name, None


def check_names(names: Iterable[str], arch: str, vllm_params: Iterable[str], *,
                tied_lm_head: bool = False) -> list[str]:
    """Raise :class:`WeightNameError` naming every weight with no vLLM parameter; return the names to send.

    With ``tied_lm_head`` (``tie_word_embeddings``) ``lm_head.weight`` is dropped: vLLM shares it
    with the embedding, which is sent anyway.
    """
    params = set(vllm_params)
    keep, bad = [], []
    for n in names:
        if tied_lm_head and normalize_name(n).endswith("lm_head.weight"):
            continue
        try:
            target, _ = vllm_param_name(n, arch)
        except WeightNameError:
            bad.append(n)
            continue
        (keep if target in params else bad).append(n)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise WeightNameError(f"{len(bad)} weight(s) are not parameters of the vLLM {arch} model: {shown}")
    return keep


class StreamGRPOWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner`` exists)."""

    def streamgrpo_param_names(self) -> list[str]:
        """Names of the model's parameters as vLLM holds them (fused ``qkv_proj``, ``gate_up_proj`` ...)."""
        return [n for n, _ in self.model_runner.get_model().named_parameters()]

    def streamgrpo_load_weights(self, names: list[str], tensors: list) -> int:
        """Reload the named tensors in place (checkpoint-format names); returns how many were given."""
        if len(names) != len(tensors):
            raise ValueError(f"streamgrpo_load_weights: {len(names)} names but {len(tensors)} tensors")
        weights = list(zip(names, tensors))
        reload = getattr(self, "reload_weights", None)  # Worker.reload_weights sets the vLLM config context
        if reload is not None:
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)

    def streamgrpo_param_sums(self, names: list[str]) -> list[float]:
        """Float sums of the given vLLM parameters (tests and audits: did an update land?)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return [float(params[n].detach().float().sum()) for n in names]
