"""Model FLOPs of a learner step and MFU (model FLOPs utilisation), from the model config alone.

Pure (no torch, no model) but for :meth:`LearnerWork.of_learner`. :class:`ModelShape` reads a Qwen2.5-VL or Qwen3-VL config (a transformers
config object or its ``to_dict()``), :class:`StepTokens` is what one learner step pushes through it
(unpadded), :class:`Training` says what trains, and :func:`step_flops` adds it up.

What is counted (one multiply-add = 2 FLOPs; matmuls only: norms, activations, rotary embeddings,
softmax and the embedding lookup are left out, as in the usual ``6·N·tokens`` rule):

* text decoder, per token and layer: the q/k/v/o projections and the gated MLP (gate, up, down);
  attention's quadratic term ``QKᵀ`` and ``AV`` over the causal pairs of each row, ``L(L+1)/2``
  (the work a causal flash kernel does; ``causal=False`` counts the full ``L²`` square);
* LM head: only at the positions that predict a completion token (the learner projects nothing
  else), ``2·hidden·vocab`` each;
* vision tower, once per group (the learner's shared vision pass): the patch embedding (a conv
  as a matmul over ``3·temporal_patch·patch²`` inputs), per block qkv + proj + MLP (gated
  for Qwen2.5-VL, two layers for Qwen3-VL), attention over each frame (full-attention blocks) or
  each window (Qwen2.5-VL's windowed blocks, exact window sizes), then the merger (and Qwen3-VL's
  deepstack mergers) on every ``merge²`` patches;
* LoRA adapters: ``2·r·(in+out)`` per adapted linear layer and token;
* with ``learner.shared_prompt`` the decoder sees each group's prompt once and its completions after
  it: the linear terms count ``P + sum(C)`` tokens per group, attention the prompt's causal pairs plus,
  per completion token, the prompt and its own completion up to itself. ``seq_tokens`` (tokens/s)
  still counts every row's prompt + completion, so tokens/s compares across the two layouts.

Forward + backward. A part's backward costs 2x its forward when its own weights train (gradients
of activations and of weights), 1x when only activation gradients pass through it (a frozen part
after, or inside, something that trains: the LoRA base, a frozen decoder above a trainable merger),
and nothing when nothing before or in it trains (a frozen vision tower costs its forward only). LoRA
adapters cost 3x their forward. ``beta > 0`` adds the reference model's forward (without adapters).
Recomputation (gradient checkpointing, the LM head's recomputed chunks) is not counted: MFU counts
the model's FLOPs, not the hardware's.

MFU = step FLOPs / (step seconds x the peak FLOP/s of every learner device). The peak comes from
``learner.peak_tflops`` when set, else from :data:`PEAK_TFLOPS` by the CUDA device's name and the
training precision (NVIDIA H100/H200/A100, AMD MI300X/MI325X/MI250X); on a CPU, or an unknown GPU, without ``learner.peak_tflops`` it is unknown and
MFU is reported as absent (``null`` in metrics.jsonl, NaN on the gauge).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamgrpo.models.batching import unwrap_model

log = logging.getLogger(__name__)
# ------------------------------------------------------------------------------------------ shapes
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class TextShape:
    """The language model: decoder layers, the LM head."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of each linear layer of one decoder layer, by its module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (biases left out)."""
        return sum(a * b for a, b in self.linear_dims().values())


@dataclass(frozen=True)
class VisionShape:
    """The vision tower: patch embedding, blocks, merger(s)."""

    depth: int
    hidden: int
    intermediate: int
    patch_inputs: int
    """Inputs of one patch to the patch embedding: channels x temporal patch x patch²."""
    merge: int
    """Spatial merge size: the merger takes ``merge²`` patches into one LLM token."""
    out_hidden: int
    gated_mlp: bool
    """Qwen2.5-VL's blocks have a gated MLP (gate, up, down); Qwen3-VL's two layers."""
    window: int | None = None
    """Qwen2.5-VL: the side of an attention window in merged units (None: every block attends a whole frame)."""
    full_blocks: int = 0
    """Blocks attending a whole frame (Qwen2.5-VL's ``fullatt_block_indexes``; all blocks without windows)."""
    mergers: int = 1
    """The merger, plus Qwen3-VL's deepstack mergers."""

    def block_params(self) -> int:
        h, i = self.hidden, self.intermediate
        return 4 * h * h + (3 if self.gated_mlp else 2) * h * i

    def merger_params(self) -> int:
        wide = self.hidden * self.merge ** 2
        return wide * wide + wide * self.out_hidden


@dataclass(frozen=True)
class ModelShape:
    text: TextShape
    vision: VisionShape

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a Qwen2.5-VL / Qwen3-VL config (transformers object or dict with text_config/vision_config)."""
        kind = _get(config, "model_type")
        if kind not in ("qwen2_5_vl", "qwen3_vl"):
            raise ValueError(f"FLOP counting knows qwen2_5_vl and qwen3_vl configs, not {kind!r}")
        t, v = _get(config, "text_config"), _get(config, "vision_config")
        heads = int(_get(t, "num_attention_heads"))
        hidden = int(_get(t, "hidden_size"))
        text = TextShape(layers=int(_get(t, "num_hidden_layers")), hidden=hidden,
                         intermediate=int(_get(t, "intermediate_size")), heads=heads,
                         kv_heads=int(_get(t, "num_key_value_heads") or heads),
                         head_dim=int(_get(t, "head_dim") or hidden // heads), vocab=int(_get(t, "vocab_size")))
        depth, patch = int(_get(v, "depth")), int(_get(v, "patch_size"))
        merge = int(_get(v, "spatial_merge_size"))
        windowed = kind == "qwen2_5_vl" and _get(v, "window_size") is not None
        vision = VisionShape(
            depth=depth, hidden=int(_get(v, "hidden_size")), intermediate=int(_get(v, "intermediate_size")),
            patch_inputs=int(_get(v, "in_channels", 3)) * int(_get(v, "temporal_patch_size")) * patch * patch,
            merge=merge, out_hidden=int(_get(v, "out_hidden_size")), gated_mlp=kind == "qwen2_5_vl",
            window=int(_get(v, "window_size")) // merge // patch if windowed else None,
            full_blocks=len(_get(v, "fullatt_block_indexes") or []) if windowed else depth,
            mergers=1 + len(_get(v, "deepstack_visual_indexes") or []),
        )
        return cls(text, vision)

    def matmul_params(self) -> dict[str, int]:
        """Matmul weights by part (biases, norms, embeddings left out; the LM head counted apart)."""
        t, v = self.text, self.vision
        return {"vision": v.patch_inputs * v.hidden + v.depth * v.block_params(),
                "merger": v.mergers * v.merger_params(), "text": t.layers * t.layer_params(),
                "head": t.hidden * t.vocab}


# ------------------------------------------------------------------------------------- step tokens
@dataclass(frozen=True)
class StepTokens:
    """What one learner step (one rank) pushes through the model, padding left out."""

    row_lengths: tuple[int, ...] = ()
    """Prompt + completion tokens of every row (one row per completion)."""
    head_tokens: int = 0
    """Positions that reach the LM head: the completion tokens."""
    grids: tuple[tuple[int, int, int], ...] = ()
    """``(t, h, w)`` patch grid of every image/video the vision tower encodes (once per group)."""
    causal_pairs: int | None = None
    """Query-key pairs the decoder's attention scores; None: the causal pairs of each row, ``n(n+1)/2``."""

    @property
    def tokens(self) -> int:
        return sum(self.row_lengths)

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    @classmethod
    def of_groups(cls, batch: Iterable[Any], shared_prompt: bool = False) -> StepTokens:
        """From accepted groups (``.group``: a ScoredGroup; ``.inputs``: its processor outputs, or None).

        ``shared_prompt`` (``learner.shared_prompt``): one row per group, its prompt once and every
        completion after it; completion r attends to the prompt and to itself only.
        """
        rows: list[int] = []
        head = pairs = 0
        grids: list[tuple[int, int, int]] = []
        for a in batch:
            prompt = len(a.group.prompt_ids)
            lens = [len(c.token_ids) for c in a.group.completions]
            if shared_prompt:
                rows.append(prompt + sum(lens))
                pairs += prompt * (prompt + 1) // 2 + sum(c * prompt + c * (c + 1) // 2 for c in lens)
            else:
                rows += [prompt + c for c in lens]
            head += sum(lens)
            grids += visual_grids(a.inputs)
        return cls(tuple(rows), head, tuple(grids), pairs if shared_prompt else None)


def visual_grids(inputs: Any) -> list[tuple[int, int, int]]:
    """The ``(t, h, w)`` grids of the images, then the videos, in processor outputs (none when None)."""
    out: list[tuple[int, int, int]] = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = None if inputs is None else _get(inputs, key)
        if grid is not None:
            rows = grid.tolist() if hasattr(grid, "tolist") else grid
            out += [(int(t), int(h), int(w)) for t, h, w in rows]
    return out


def _window_sq_sum(n: int, window: int) -> int:
    """Sum of squared chunk sizes when ``n`` is cut into chunks of ``window`` (the last one shorter)."""
    full, rest = divmod(n, window)
    return full * window * window + rest * rest


def vision_attention_pairs(grids: Iterable[tuple[int, int, int]], vision: VisionShape) -> tuple[int, int]:
    """``(full, windowed)``: query-key pairs of one full-attention block (each frame attends itself)
    and of one windowed block (each window of ``window x window`` merged units attends itself)."""
    full = windowed = 0
    m2 = vision.merge ** 2
    for t, h, w in grids:
        full += t * (h * w) ** 2
        if vision.window is not None:
            hm, wm = h // vision.merge, w // vision.merge
            windowed += t * m2 * m2 * _window_sq_sum(hm, vision.window) * _window_sq_sum(wm, vision.window)
    return full, windowed


# --------------------------------------------------------------------------------------- counting
@dataclass(frozen=True)
class Training:
    """What trains; decides each part's backward (see the module docstring)."""

    vision: bool = False
    merger: bool = True
    llm: bool = True
    lora_r: int = 0
    """LoRA rank (0: no adapters). With LoRA nothing else trains."""
    lora_targets: tuple[str, ...] = ()
    reference: bool = False
    """``loss.beta > 0``: a reference forward per step."""
    shared_prompt: bool = False
    """``learner.shared_prompt``: each group's prompt goes through the decoder once, not once per completion."""

    @classmethod
    def from_config(cls, cfg: Any) -> Training:
        """From a streamgrpo Config (``model.tune_mm_*``, ``model.lora``, ``loss.beta``)."""
        lora, m = cfg.model.lora, cfg.model
        reference = cfg.loss.beta > 0
        shared = cfg.learner.shared_prompt
        if lora is not None:
            return cls(vision=False, merger=False, llm=False, lora_r=lora.r,
                       lora_targets=tuple(lora.target_modules), reference=reference, shared_prompt=shared)
        return cls(vision=m.tune_mm_vision, merger=m.tune_mm_mlp, llm=m.tune_mm_llm, reference=reference,
                   shared_prompt=shared)


@dataclass(frozen=True)
class PartFlops:
    """Forward FLOPs of each part of the model for one :class:`StepTokens`."""

    vision: float = 0.0
    merger: float = 0.0
    text: float = 0.0
    head: float = 0.0
    adapters: float = 0.0

    @property
    def total(self) -> float:
        return self.vision + self.merger + self.text + self.head + self.adapters


def lora_params_per_layer(text: TextShape, r: int, targets: Iterable[str]) -> int:
    """Adapter weights of one decoder layer: ``r·(in+out)`` per adapted linear layer."""
    dims = text.linear_dims()
    return sum(r * (dims[t][0] + dims[t][1]) for t in set(targets) if t in dims)


def forward_flops(shape: ModelShape, work: StepTokens, training: Training = Training(), *,
                  causal: bool = True) -> PartFlops:
    """Forward FLOPs of the policy (adapters included) on ``work``."""
    t, v = shape.text, shape.vision
    if causal and work.causal_pairs is not None:
        pairs = work.causal_pairs
    else:
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in work.row_lengths)
    text = 2.0 * work.tokens * t.layers * t.layer_params() + 4.0 * t.heads * t.head_dim * t.layers * pairs
    full, windowed = vision_attention_pairs(work.grids, v)
    window_blocks = v.depth - v.full_blocks
    patches = work.patches
    vision = (2.0 * patches * (v.patch_inputs * v.hidden + v.depth * v.block_params())
              + 4.0 * v.hidden * (v.full_blocks * full + window_blocks * windowed))
    merger = 2.0 * (patches // v.merge ** 2) * v.mergers * v.merger_params()
    adapters = 2.0 * work.tokens * t.layers * lora_params_per_layer(t, training.lora_r, training.lora_targets)
    return PartFlops(vision=vision, merger=merger, text=text, head=2.0 * work.head_tokens * t.hidden * t.vocab,
                     adapters=adapters)


def multipliers(training: Training) -> dict[str, int]:
    """Forward + backward cost of each part in units of its forward (1, 2 or 3)."""
    order = (("vision", training.vision, training.vision), ("merger", training.merger, training.merger),
             ("text", training.llm, training.llm or training.lora_r > 0), ("head", training.llm, False))
    out, earlier = {}, False
    for name, weights, spread in order:
        out[name] = 1 + int(spread or earlier) + int(weights)
        earlier = earlier or weights or spread
    return out


def step_flops(shape: ModelShape, work: StepTokens, training: Training = Training()) -> float:
    """Model FLOPs of one learner step (forward + backward, plus the reference forward when ``beta > 0``)."""
    fwd = forward_flops(shape, work, training)
    mult = multipliers(training)
    total = sum(getattr(fwd, name) * k for name, k in mult.items()) + 3.0 * fwd.adapters
    if training.reference:
        total += fwd.total - fwd.adapters
    return total


@dataclass(frozen=True)
class FlopCounter:
    """One learner's FLOP model: its shape and what trains (built once, applied per step)."""

    shape: ModelShape
    training: Training = field(default_factory=Training)

    @classmethod
    def for_learner(cls, model_config: Any, cfg: Any) -> FlopCounter:
        return cls(ModelShape.from_config(model_config), Training.from_config(cfg))

    def of_groups(self, batch: Iterable[Any]) -> tuple[int, float]:
        """``(tokens, model FLOPs)`` of one rank's step on accepted groups."""
        rows = StepTokens.of_groups(batch)  # tokens/s counts every row's prompt + completion, whatever the layout
        work = StepTokens.of_groups(batch, shared_prompt=True) if self.training.shared_prompt else rows
        return rows.tokens, step_flops(self.shape, work, self.training)


@dataclass(frozen=True)
class LearnerWork:
    """A learner rank's FLOP model and its device's peak: the numbers of each step it trains."""

    counter: FlopCounter
    peak_flops: float | None

    @classmethod
    def of_learner(cls, model: Any, cfg: Any, device: Any) -> LearnerWork:
        """For the learner's (peft/DeepSpeed-wrapped) ``model`` on ``device`` (the one impure helper: torch)."""
        import torch


        counter = FlopCounter.for_learner(unwrap_model(model).config, cfg)
        cuda = torch.device(device).type == "cuda"
        name = torch.cuda.get_device_name(device) if cuda else None
        precision = "bf16" if cfg.learner.bf16 else "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        peak = device_peak_flops(cfg.learner.peak_tflops, name, precision)
        if peak is None and cuda:
            log.info("MFU not reported: no peak FLOP/s known for %s (set learner.peak_tflops)", name)
        return cls(counter, peak)

    def of_groups(self, batch: Iterable[Any]) -> dict[str, Any]:
        """``seq_tokens``, ``flops`` and ``peak_flops`` of one rank's step (:class:`~streamgrpo.learner.step_data.StepOutput` fields)."""
        tokens, flops = self.counter.of_groups(batch)
        return {"seq_tokens": tokens, "flops": flops, "peak_flops": self.peak_flops}


# ---------------------------------------------------------------------------------------- peak, MFU
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], tuple[float, float, float]], ...] = (
    # (name parts, all present) -> dense peak TFLOP/s (bf16/fp16 tensor cores, tf32 tensor cores, fp32)
    (("H100", "NVL"), (835.5, 417.5, 60.0)),
    (("H200", "NVL"), (835.5, 417.5, 60.0)),
    (("H200",), (989.4, 494.7, 66.9)),
    (("H100", "PCIE"), (756.5, 378.0, 51.2)),
    (("H100",), (989.4, 494.7, 66.9)),  # SXM ("NVIDIA H100 80GB HBM3")
    (("A100",), (312.0, 156.0, 19.5)),
    # AMD Instinct, as ROCm's torch names them ("AMD Instinct MI300X"): dense matrix peaks from AMD's data
    # sheets (amd.com/en/products/accelerators/instinct/mi300/mi300x.html, .../mi325x.html,
    # .../mi200/mi250x.html) and ROCm's "MI300 microarchitecture" page. MI300X and MI325X: BF16 1307.4, TF32
    # 653.7, FP32 163.4; MI250X: BF16 383.0, no TF32 (tf32 matmuls run as FP32 matrix ops: 95.7), FP32 95.7.
    (("MI325X",), (1307.4, 653.7, 163.4)),
    (("MI300X",), (1307.4, 653.7, 163.4)),
    (("MI250X",), (383.0, 95.7, 95.7)),
)
PRECISIONS = ("bf16", "tf32", "fp32")


def peak_tflops(device_name: str | None, precision: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of a GPU by its name (``torch.cuda.get_device_name()``, ROCm's torch too); None if unknown."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    if not device_name:
        return None
    name = device_name.upper()
    for parts, peaks in PEAK_TFLOPS:
        if all(p in name for p in parts):
            return peaks[PRECISIONS.index(precision)]
    return None


def device_peak_flops(configured_tflops: float | None, device_name: str | None, precision: str) -> float | None:
    """Peak FLOP/s of one learner device: ``learner.peak_tflops`` when set, else the table (CUDA only)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    tflops = peak_tflops(device_name, precision)
    return None if tflops is None else tflops * 1e12


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation; None when the peak is unknown or nothing was timed."""
    if peak_flops is None or peak_flops <= 0 or seconds <= 0:
        return None
    return flops / (seconds * peak_flops)
