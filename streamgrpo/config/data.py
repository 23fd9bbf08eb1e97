"""The ``data`` section: where records and media are, how frames are sampled and sized."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from streamgrpo.sections import Section


class DataConfig(Section):
    train_path: str = "data/demo/train.jsonl"
    """Training records: LLaVA-style JSON array or JSONL, or a Hugging Face `datasets` directory."""
    eval_path: Optional[str] = None
    """Held-out records: what the evaluator scores at the learner's weight versions (eval.enabled, `streamgrpo evaluator`); `streamgrpo eval` takes its own --data."""
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
    max_question_chars: int = Field(100_000, ge=1, le=1 << 30)
    """A record whose question is longer than this many characters is skipped (counted as a data error, named by `streamgrpo data check`): one huge record would otherwise stop the tokenizer on every pass."""
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
