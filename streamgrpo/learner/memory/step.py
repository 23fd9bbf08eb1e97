"""What one training step adds on top of a learner rank's static memory, and what a generator adds on
top of its weights: pure arithmetic over the model's layer sizes (:class:`~streamgrpo.models.params.ModelShape`),
the parameter counts and the step's token budget (:class:`Workload`).

The parts (bytes on one rank; ``T``: decoder tokens of a micro-batch, ``L`` layers, ``H`` hidden,
``I`` intermediate, ``V`` vocabulary, ``W`` ranks; activations in bf16, 2 bytes):

* **optimizer temporaries** (:func:`optimizer_temporaries`). torch's fused AdamW (the learner's kernel
  on a GPU, :func:`~streamgrpo.learner.optim.fused_adamw`) updates in place, one kernel per list of
  tensors: what it and the gradient clipping allocate is of the order of one float32 copy of the
  largest trained tensor (the embedding), ``4 x largest``; the foreach path makes whole-list
  temporaries (``_foreach_sqrt`` of the second moments is one float32 copy of the group's
  parameters), so ``4 x trained``; the CPU for-loop ``4 x largest``. DeepSpeed ZeRO-1/2/3 cast the
  gradient partition to float32 before the step (``flat_grad_partition.to(fp32)``: ``4 x trained / W``,
  the +11.63 GiB a 3B ZeRO-2 rank ran out of memory on), and keep their flat communication buckets
  (``reduce_bucket_size`` elements in the weights' dtype, twice with ``overlap_comm``; the all-gather
  bucket with several ranks; ZeRO-3 the layers it gathers, ``stage3_max_live_parameters`` plus the
  prefetch bucket). With ``offload_optimizer: cpu`` the step runs on the host: the device keeps the
  buckets and the host a pinned float32 bucket the gradients go through.
* **activations** (:func:`activation_bytes`), from the micro-batch's token budget: with gradient
  checkpointing each recomputed layer keeps its input (``L x T x H x 2``; on the host with
  ``learner.checkpoint_offload``), with ``learner.checkpoint_matmuls`` also its matmul and attention
  outputs (``T x (4 H + 2 K + 2 I) x 2``: q, attention, o, down; k, v of ``K`` = key-value heads x head
  dim; gate, up; on the device even with the offload); a layer that is not recomputed keeps ``T x (10 H + 4 I) x 2``
  (norms, q/k/v, attention output, residuals; gate, up, activation, product); and the layer being
  recomputed and differentiated holds its working set ``T x (8 H + 4 I) x 2``. LoRA with dropout adds
  the dropped inputs of the adapted linears, ``T x (6 H + I) x 2``.
* **logits**: the learner computes log-probs ``chunk_tokens`` (1024) rows at a time
  (:func:`~streamgrpo.models.logprobs.chunked_token_logprobs`), so ``min(1024, completion tokens) x V x 4``,
  twice for logsumexp's work, not the whole micro-batch's logits.
* **reference forward** (``loss.beta > 0``): the reference's no-grad forward over the micro-batch
  holds one layer's ``T x (4 H + 2 I) x 2`` (its logits are the same chunks).
* **vision encoder** (:func:`vision_bytes`): the micro-batch's videos (each group's once; ``N`` patches,
  ``merge^2`` = 4 to a video token) go through the frozen trunk without gradients before the decoder runs:
  the patchified pixels as the processor gives them (float32) and their copy in the tower's dtype
  (``N x patch values x (4 + 2)``, 1,176 values a Qwen2.5-VL patch), the trunk's kept block output(s)
  (``N x Hv x 2``, Qwen3-VL's deepstack blocks too) and the merged features (``N / 4 x H x 2``) stay
  through the step; one block's no-grad working set ``N x (6 Hv + 3 Iv) x 2`` (the block's input, norm,
  q/k/v with q and k rotated in float32, attention output; or the MLP's gate, up, product) comes
  before the decoder's phase, so only what it exceeds the decoder's transient parts (the working set,
  the logits, the reference's forward) is added.
* **attention mask** (:func:`mask_bytes`): with sdpa or eager attention (not flash-attention) the decoder
  takes a 4D mask, ``sequences x L^2`` per micro-batch: the rows' padding mask (transformers builds it
  when the rows are padded, ``L = P + C``), or the shared prompt's block mask (one packed row a group,
  ``L = P + G x C``). The boolean mask is kept through the forward (1 byte an element); inside each
  attention call sdpa turns it into an additive one in the activations' dtype (2) and pads that to 16
  keys for its memory-efficient kernel (2 more): :data:`MASK_BYTES` = 1 + 4. Eager attention instead
  keeps an additive mask (2) and materializes the call's scores (``heads x L^2``, bf16 and their float32
  softmax). The call's copies live while the layer's MLP tensors do not, so they count only by what they
  exceed the working set's MLP share (``T x 4 I x 2``). This is the one part that grows with the square of
  the frames: 0.04 GiB at 16 frames of 448², the largest part of a shared-prompt plan at a thousand.

``T`` is ``learner.micro_batch_tokens`` when set, else the step's share of one rank:
``groups_per_step / W x G x (P + C)``, or ``groups_per_step / W x (P + G x C)`` with
``learner.shared_prompt``; ``P`` = ``data.max_frames x data.max_pixels`` (capped at
``data.total_pixels``) / pixels per video token (Qwen2.5-VL: 28 x 28 x 2) + :data:`PROMPT_TEXT_TOKENS`,
``C`` = ``rollout.max_completion_length``. With ``learner.sequence_parallel: N`` the ranks of a group share its
groups (``groups_per_step / (W / N)`` a group), and a rank's layers hold ``T / N`` tokens: the activations, the
working set, the reference's forward divide by N; the exchange of q, k, v and the attention output adds
``T / N x 2 x (2 H + 2 K) x 2`` (sent and received); the logits do not (the rank whose columns predict the
completions computes them, in the same chunks), nor the vision pass but its block's working set (a frozen
trunk's frames are split over the group; the pixels and the gathered block outputs are whole), nor the shared
prompt's block mask (whole on each rank; rows under sdpa need none: causal). The parts are added up (each phase's peak is not
separated: a plan over the device refuses, a plan a little above the peak is fine).

A generator (:func:`generator_memory`): the HF engine's KV cache (``L x 2 x kv_heads x head_dim x
dtype x S x (P + C)`` for ``S = rollout.prompts_per_batch x G`` sequences: each prompt is prefilled once
and its cache repeated to its G sequences, G copies while decoding, nothing shared), its prefill's one
layer over the prompts only (``prompts x P x (4 H + 2 I) x dtype``: streamgrpo/engines/hf.py) and the
sampling logits (``S x V x 4 x 2``; transformers keeps the last position's only); the video features,
encoded once per prompt (``prompts x P_v x H x dtype``); the vision encoder's pass over each prompt's
patches (pixels, and one block's working set beyond the prefill's); and with several prompts a batch
(left-padded) the prefill's attention mask ``prompts x P^2 x`` :data:`MASK_BYTES` (one prompt is not
padded: sdpa runs causal, no mask). vLLM takes its ``gpu_memory_utilization`` share (counted by the
placement plan).

Calibrated against CUDA peaks on one H100 80 GB (2026-11-26; tests/unit/learner/memory/test_memory_step.py and
docs/gpu.md have the table): 3B full torch 58.8 GiB measured, 3B shared prompt 56.2, 7B LoRA r=64 30.5,
all within 10%; a 3B ZeRO-2 rank colocated with an HF generator ran out of memory and its plan is over
79 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamgrpo.models.attention import choose, is_rocm

if TYPE_CHECKING:
    from streamgrpo.learner.memory.placement import Placement
    from streamgrpo.models.params import ModelShape, ParamCounts

PROMPT_TEXT_TOKENS = 128
"""Text tokens of a prompt besides its visuals (chat template, system prompt, question): an estimate."""
CHUNK_TOKENS = 1024
"""Rows of logits the learner computes at a time: :data:`streamgrpo.models.logprobs.CHUNK_TOKENS` (not imported:
this plan loads without torch)."""
ACT_BYTES = 2
"""Activations are bf16 (autocast, or a bf16 engine)."""

_WORK = (8, 4)  # one recomputed layer's forward + backward working set, per token, x (H, I)
_KEPT = (10, 4)  # a layer that keeps its activations (no recompute), per token, x (H, I)
_LORA = (6, 1)  # LoRA dropout's copies of the adapted linears' inputs (q, k, v, o, gate, up: H; down: I)
_NOGRAD = (4, 2)  # one layer of a forward without gradients (the reference, a generator's prefill)
_VISION_WORK = (6, 3)  # one vision block's no-grad working set, per patch, x (Hv, Iv)
PIXEL_BYTES = 4 + 2
"""A patch value on the device: the processor's float32 and the tower's bf16 copy."""
MASK_BYTES = 5
"""A 4D attention mask element under sdpa: the kept boolean (1), and inside the call sdpa's additive copy (2)
and its copy padded to 16 keys (2)."""


@dataclass(frozen=True)
class Workload:
    """One micro-batch of one learner rank, as the memory plan sees it."""

    tokens: float
    """Decoder tokens of the micro-batch (prompts and completions)."""
    completion_tokens: float
    """Of which completion tokens (the rows that need logits)."""
    gradient_checkpointing: bool = False
    checkpoint_every: int = 1
    checkpoint_offload: bool = False
    checkpoint_matmuls: bool = False
    """``learner.checkpoint_matmuls``: each recomputed layer keeps its matmul and attention outputs too."""
    reference_forward: bool = False
    """``loss.beta > 0``: the reference's forward over the micro-batch."""
    lora_dropout: bool = False
    chunk_tokens: int = CHUNK_TOKENS
    vision_patches: float = 0.0
    """Vision patches the micro-batch encodes (each group's video once)."""
    mask_elements: float = 0.0
    """Elements of the decoder's 4D attention mask (``sequences x L^2``; 0 with flash-attention)."""
    eager_attention: bool = False
    """``attn_implementation: eager``: each layer's scores are materialized too."""
    sequence_parallel: int = 1
    """``learner.sequence_parallel``: the ranks a micro-batch's sequences are split over (each holds 1/N of the
    decoder's tokens)."""

    @property
    def local_tokens(self) -> float:
        """Decoder tokens this rank's layers hold: ``tokens / sequence_parallel``."""
        return self.tokens / max(1, self.sequence_parallel)


def prompt_tokens(cfg: Any, shape: ModelShape) -> int:
    """A prompt's decoder tokens: the largest video ``data`` allows, plus :data:`PROMPT_TEXT_TOKENS`."""
    d = cfg.data
    pixels = min(d.max_frames * d.max_pixels, d.total_pixels)
    return int(pixels // shape.pixels_per_video_token) + PROMPT_TEXT_TOKENS


def decoder_attention(cfg: Any, flash_attn: bool | None = None) -> str:
    """The kernel the learner's decoder will run (``model.attn_implementation`` resolved as the learner
    resolves it, on a CUDA device): ``flash_attn`` says whether the flash-attn package is there (None:
    whether it imports here)."""
    import importlib.util


    if flash_attn is None:
        flash_attn = importlib.util.find_spec("flash_attn") is not None
    custom = bool(cfg.learner.shared_prompt) or getattr(cfg.learner, "sequence_parallel", 1) > 1  # as the learner
    return choose(cfg.model.attn_implementation, cuda=True, flash_attn=flash_attn, custom_mask=custom,
                  rocm=is_rocm()).kernel


def workload(cfg: Any, shape: ModelShape, world_size: int = 1, *, flash_attn: bool | None = None) -> Workload:
    """The :class:`Workload` of a config's micro-batch on one of ``world_size`` learner ranks
    (``flash_attn``: see :func:`decoder_attention`)."""
    lc, g, c = cfg.learner, cfg.rollout.num_generations, cfg.rollout.max_completion_length
    p = prompt_tokens(cfg, shape)
    sp = max(1, getattr(lc, "sequence_parallel", 1))
    groups = lc.groups_per_step / max(1, world_size // sp)  # a sequence-parallel group's ranks share its groups
    per_group = p + g * c if lc.shared_prompt else g * (p + c)
    tokens = groups * per_group
    if lc.micro_batch_tokens is not None:
        tokens = min(tokens, max(lc.micro_batch_tokens, per_group if lc.shared_prompt else p + c))
    lora = cfg.model.lora
    videos = max(1, math.ceil(tokens / per_group - 1e-9))  # a micro-batch with any row of a group encodes its video
    patches = videos * (p - PROMPT_TEXT_TOKENS) * shape.patches_per_token if shape.vision_hidden else 0.0
    kernel = decoder_attention(cfg, flash_attn)
    length = p + g * c if lc.shared_prompt else p + c  # one sequence of the forward
    mask = 0.0 if kernel == "flash_attention_2" else tokens / length * length * length
    if sp > 1 and kernel == "sdpa" and not lc.shared_prompt:  # rows split over ranks attend causally: no mask
        mask = 0.0
    return Workload(tokens=tokens, completion_tokens=tokens * g * c / per_group,
                    gradient_checkpointing=lc.gradient_checkpointing, checkpoint_every=lc.checkpoint_every,
                    checkpoint_offload=lc.checkpoint_offload, checkpoint_matmuls=lc.checkpoint_matmuls,
                    reference_forward=cfg.loss.beta > 0,
                    lora_dropout=bool(lora is not None and lora.dropout > 0),
                    vision_patches=float(patches), mask_elements=float(mask), eager_attention=kernel == "eager",
                    sequence_parallel=sp)


def _per_token(shape: ModelShape, factors: tuple[int, int]) -> float:
    return (factors[0] * shape.hidden + factors[1] * shape.intermediate) * ACT_BYTES


def _matmul_outputs(shape: ModelShape) -> float:
    """``learner.checkpoint_matmuls``: a recomputed layer's kept matmul and attention outputs, bytes per token
    (q, attention, o, down: H each; k and v: key-value heads x head dim each; gate, up: I each)."""
    return (4 * shape.hidden + 2 * shape.kv_heads * shape.head_dim + 2 * shape.intermediate) * ACT_BYTES


def activation_bytes(shape: ModelShape, work: Workload) -> tuple[float, float]:
    """(device, host) bytes of the micro-batch's activations (the module docstring has the rule)."""
    t = work.local_tokens
    recomputed = math.ceil(shape.layers / work.checkpoint_every) if work.gradient_checkpointing else 0
    saved_inputs = recomputed * t * shape.hidden * ACT_BYTES
    kept = (shape.layers - recomputed) * t * _per_token(shape, _KEPT)
    if work.checkpoint_matmuls:
        kept += recomputed * t * _matmul_outputs(shape)
    working = t * _per_token(shape, _WORK) + (t * _per_token(shape, _LORA) if work.lora_dropout else 0.0)
    if work.checkpoint_offload:
        return kept + working, saved_inputs
    return saved_inputs + kept + working, 0.0


def optimizer_temporaries(counts: ParamCounts, place: Placement) -> tuple[float, float]:
    """(device, host) bytes the optimizer step allocates on top of the static plan (module docstring)."""
    n = counts.trainable
    largest = counts.largest or n
    if place.backend != "deepspeed":
        return (4.0 * n if place.optimizer_impl == "foreach" else 4.0 * largest), 0.0
    w = max(1, place.world_size)
    weight_b = 2 if place.bf16 else 4
    buckets = place.reduce_bucket * weight_b * (2 if place.overlap_comm else 1)
    if w > 1:
        buckets += place.allgather_bucket * weight_b
    if place.zero_stage >= 3:
        n_all = counts.total + (counts.trainable if counts.lora else 0)
        buckets += (min(place.live_params, n_all) + place.prefetch_bucket) * weight_b
    if place.offload_optimizer in ("cpu", "nvme"):
        return buckets, 4.0 * place.reduce_bucket  # the step runs on the host, through a pinned bucket
    return 4.0 * n / w + buckets, 0.0  # flat_grad_partition.to(fp32)


def step_memory(counts: ParamCounts, shape: ModelShape, place: Placement,
                work: Workload) -> tuple[dict[str, float], dict[str, float]]:
    """The step's parts on the device and on the host: optimizer temporaries, activations, logits and
    the reference's forward (the module docstring has the rules)."""
    opt_dev, opt_host = optimizer_temporaries(counts, place)
    act_dev, act_host = activation_bytes(shape, work)
    rows = min(work.chunk_tokens, work.completion_tokens)  # a rank of a sequence-parallel group may own them all
    t = work.local_tokens
    device = {"optimizer temporaries": opt_dev, "activations": act_dev, "logits": rows * shape.vocab * 4 * 2,
              "reference forward": t * _per_token(shape, _NOGRAD) if work.reference_forward else 0.0}
    if work.sequence_parallel > 1:  # q, k, v and the attention output of a layer, sent and received
        device["sequence exchange"] = t * 2 * (2 * shape.hidden + 2 * shape.kv_heads * shape.head_dim) * ACT_BYTES
    decoder_transient = (t * _per_token(shape, _WORK) + device["logits"] + device["reference forward"])
    device["vision encoder"] = vision_bytes(shape, work.vision_patches, beside=decoder_transient,
                                            split=work.sequence_parallel)
    device["attention mask"] = mask_bytes(shape, work.mask_elements, eager=work.eager_attention,
                                          beside=t * 4 * shape.intermediate * ACT_BYTES)
    host = {"optimizer temporaries": opt_host, "activations": act_host}
    return device, host


def vision_bytes(shape: ModelShape, patches: float, *, beside: float = 0.0, dtype_bytes: int = ACT_BYTES,
                 features: float = 1.0, replay: bool = True, split: int = 1) -> float:
    """The vision encoder's bytes for ``patches`` patches (the module docstring has the rule): the pixels,
    with ``replay`` the frozen trunk's kept block outputs, ``features`` copies of the merged features, and
    one block's no-grad working set where it exceeds ``beside`` (the transient parts of the phase that
    follows it); ``split``: the frozen trunk's frames split over a sequence-parallel group (the working set
    is a rank's share; the pixels and the gathered kept outputs stay whole)."""
    if not shape.vision_hidden or patches <= 0:
        return 0.0
    pixels = patches * shape.patch_values * PIXEL_BYTES
    kept = patches * shape.vision_hidden * dtype_bytes * shape.vision_kept if replay else 0.0
    merged = features * patches / shape.patches_per_token * shape.hidden * dtype_bytes
    working = patches / max(1, split) * (_VISION_WORK[0] * shape.vision_hidden
                                         + _VISION_WORK[1] * shape.vision_intermediate) * dtype_bytes
    return float(pixels + kept + merged + max(0.0, working - beside))


def mask_bytes(shape: ModelShape, elements: float, *, eager: bool = False, beside: float = 0.0) -> float:
    """The decoder's 4D attention mask of ``elements`` (``sequences x L^2``): under sdpa the kept boolean
    (1 byte each) and the call's copies (:data:`MASK_BYTES` - 1), eager an additive mask (2) and one call's
    scores, bf16 and their float32 softmax, per head; the call's part only where it exceeds ``beside``
    (what of the layer's working set is not alive during the call: module docstring)."""
    if eager:
        heads = shape.heads or shape.hidden // shape.head_dim
        kept, call = 2.0, heads * (2 + 4)
    else:
        kept, call = 1.0, MASK_BYTES - 1.0
    return float(elements * kept + max(0.0, elements * call - beside))


def generator_memory(shape: ModelShape, *, sequences: int, prompt_tokens: int, completion_tokens: int,
                     dtype_bytes: int, prompts: int = 1, video_tokens: int = 0) -> dict[str, float]:
    """An HF-engine generator's working memory on top of its weights, by part: the KV cache of
    ``sequences`` sequences of ``prompt_tokens + completion_tokens`` (``prompts`` distinct prompts, each
    ``sequences / prompts`` times), its prefill's one layer (over each prompt once), the sampling logits,
    the video features (``video_tokens`` a prompt, encoded once a prompt), the vision encoder's pass and,
    with several (left-padded) prompts, the prefill's attention mask (module docstring)."""
    kv = shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes * sequences * (
        prompt_tokens + completion_tokens)
    prefill = prompts * prompt_tokens * (_NOGRAD[0] * shape.hidden + _NOGRAD[1] * shape.intermediate) * dtype_bytes
    features = prompts * video_tokens * shape.hidden * dtype_bytes
    vision = vision_bytes(shape, prompts * video_tokens * shape.patches_per_token, beside=prefill,
                          dtype_bytes=dtype_bytes, features=0.0, replay=False)
    mask = prompts * prompt_tokens * prompt_tokens * MASK_BYTES if prompts > 1 else 0.0
    return {"kv cache": float(kv), "prefill": float(prefill), "logits": float(sequences * shape.vocab * 4 * 2),
            "video features": float(features), "vision encoder": float(vision), "attention mask": float(mask)}


def generator_parts(cfg: Any, shape: ModelShape) -> dict[str, float]:
    """:func:`generator_memory` of a config's HF generator (``rollout.prompts_per_batch x G`` sequences)."""
    r = cfg.rollout
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    p = prompt_tokens(cfg, shape)
    parts = generator_memory(shape, sequences=r.prompts_per_batch * r.num_generations, prompt_tokens=p,
                             completion_tokens=r.max_completion_length, dtype_bytes=dtype_bytes,
                             prompts=r.prompts_per_batch, video_tokens=p - PROMPT_TEXT_TOKENS)
    if getattr(r, "vision_cache_mib", 0):
        parts["vision cache"] = float(r.vision_cache_mib << 20)  # kept features, at most this (engines/vision_features.py)
    return parts


def generator_step_bytes(cfg: Any, shape: ModelShape) -> float:
    """The sum of :func:`generator_parts`."""
    return sum(generator_parts(cfg, shape).values())
