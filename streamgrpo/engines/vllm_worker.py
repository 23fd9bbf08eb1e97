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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


def vllm_module(name: str, arch: str) -> str:
    """The vLLM module a learner weight lands in (its vLLM parameter name without ``.weight``/``.bias``)."""
    return vllm_param_name(name, arch)[0].rsplit(".", 1)[0]


def missing_for_reload(names: Iterable[str], checkpoint_names: Iterable[str], arch: str) -> list[str]:
    """Checkpoint tensors to add so that every vLLM module touched by ``names`` is reloaded whole.

    vLLM reloads layer by layer and cannot reload part of a layer: sending ``q_proj``/``v_proj``
    (a LoRA-merged update) without ``k_proj`` and the biases leaves the fused ``qkv_proj`` broken.
    Names are compared by the vLLM parameter and shard they land in, so the learner's naming and the
    checkpoint's (older Qwen2.5-VL checkpoints say ``model.layers.*``) may differ.
    """
    have, touched = set(), set()
    for n in names:
        target = vllm_param_name(n, arch)
        have.add(target)
        touched.add(target[0].rsplit(".", 1)[0])
    out = []
    for c in checkpoint_names:
        try:
            target = vllm_param_name(c, arch)
        except WeightNameError:
            continue
        if target not in have and target[0].rsplit(".", 1)[0] in touched:
            out.append(c)
            have.add(target)
    return sorted(out)


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


def pack_tensor(t) -> tuple[str, list[int], memoryview]:
    """``(dtype name, shape, raw bytes)`` of a CPU tensor: what crosses vLLM's RPC channel.

    vLLM's msgpack decoder rebuilds tensors only where the receiving signature is typed, so an
    untyped RPC argument would arrive as a nested list; raw bytes arrive as bytes (large ones
    out of band, without a copy into the message).
    """
    import torch

    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return name, [int(d) for d in t.shape], memoryview(raw.numpy()).cast("B")


def unpack_tensor(dtype: str, shape: list[int], buf) -> torch.Tensor:
    """The tensor :func:`pack_tensor` described (shares ``buf``'s memory where it can)."""
    import warnings

    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unpack_tensor: unknown dtype {dtype!r}")
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty(0, dtype=torch_dtype).element_size()
    if len(buf) != nbytes:
        raise ValueError(f"unpack_tensor: {len(buf)} bytes for {dtype} {list(shape)} (expected {nbytes})")
    if nbytes == 0:
        return torch.empty([int(d) for d in shape], dtype=torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the loader copies out of it
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(torch_dtype).reshape([int(d) for d in shape])


def transformers_mrope_positions(num_tokens: int, blocks: Iterable[tuple[int, int, int, int, float]]):
    """m-RoPE positions (3, L) int64 and the completion offset of a prompt, by the rule of
    transformers 5.x's Qwen2.5-VL ``get_rope_index`` (what the learner and the HF engine use).

    ``blocks``: ``(offset, t, h, w, t_factor)`` per image/video in prompt order, ``h``/``w``
    already divided by the spatial merge size, ``t_factor = second_per_grid_t * tokens_per_second``
    (1 for images): the tuples vLLM's ``Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw``
    yields. Text after a vision block continues at ``block start + max(h, w)``; vLLM's own rule
    (the original Qwen code) continues at the block's largest position + 1, which is larger when
    the video's temporal extent ``(t - 1) * t_factor`` reaches ``max(h, w)``. Completion token i
    gets ``last prompt position + 1 + i`` (the learner's rule), i.e. ``num_tokens + i + delta``.
    """
    import numpy as np

    parts, cur, st = [], 0, 0
    for off, t, h, w, t_factor in blocks:
        n_text = int(off) - st
        if n_text < 0:
            raise ValueError(f"vision block at offset {off} overlaps the previous one (ends at {st})")
        parts.append(np.broadcast_to(np.arange(n_text, dtype=np.int64), (3, n_text)) + cur)
        cur += n_text
        # float32 like transformers (arange * time_interval tensor), truncated like .long()
        t_pos = (np.arange(int(t), dtype=np.float32) * np.float32(t_factor)).astype(np.int64) + cur
        grid = np.stack(np.meshgrid(t_pos, np.arange(int(h)) + cur, np.arange(int(w)) + cur, indexing="ij"))
        parts.append(grid.reshape(3, -1).astype(np.int64))
        cur += max(int(h), int(w))
        st = int(off) + int(t) * int(h) * int(w)
    if st > num_tokens:
        raise ValueError(f"vision blocks end at {st}, past the prompt's {num_tokens} tokens")
    if st < num_tokens:
        parts.append(np.broadcast_to(np.arange(num_tokens - st, dtype=np.int64), (3, num_tokens - st)) + cur)
    pos = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
    delta = (int(pos[0, -1]) + 1 - num_tokens) if num_tokens else 0
    return np.ascontiguousarray(pos), delta


class StreamGRPOWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner`` exists)."""

    def streamgrpo_param_names(self) -> list[str]:
        """Names of the model's parameters as vLLM holds them (fused ``qkv_proj``, ``gate_up_proj`` ...)."""
        return [n for n, _ in self.model_runner.get_model().named_parameters()]

    def streamgrpo_load_weights(self, packed: list) -> int:
        """Reload ``[(name, dtype, shape, bytes), ...]`` in place (checkpoint-format names, see
        :func:`pack_tensor`); returns how many tensors were loaded."""
        weights = [(name, unpack_tensor(dtype, shape, buf)) for name, dtype, shape, buf in packed]
        reload = getattr(self, "reload_weights", None)  # Worker.reload_weights sets the vLLM config context
        if reload is not None:
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)

    def streamgrpo_use_learner_positions(self) -> bool:
        """Make the model compute prompt m-RoPE positions by :func:`transformers_mrope_positions`
        (Qwen2.5-VL only; True when installed). Patches the instance's ``get_mrope_input_positions``,
        which the model runner calls once per new request."""
        import torch

        model = self.model_runner.get_model()
        if not (hasattr(model, "iter_mm_grid_thw") and hasattr(model, "get_mrope_input_positions")):
            return False

        def get_mrope_input_positions(input_tokens, mm_features):
            pos, delta = transformers_mrope_positions(len(input_tokens), model.iter_mm_grid_thw(mm_features))
            return torch.from_numpy(pos), delta

        model.get_mrope_input_positions = get_mrope_input_positions
        return True
