"""The ``eval`` section: the evaluator, which scores held-out records at the learner's weight versions."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class EvalConfig(Section):
    enabled: bool = False
    """`streamgrpo up` starts the evaluator beside the learner and the generators (it needs data.eval_path); `streamgrpo evaluator` runs it on another machine either way."""
    every_versions: int = Field(10, ge=1)
    """Evaluate the held-out set (data.eval_path) at every this many-th weight version, and at the run's last one (learner.max_steps); versions in between, and any the evaluator falls behind on, are skipped (counted in streamgrpo_eval_versions_skipped_total)."""
    samples: int = Field(1, ge=1, le=64)
    """Completions per held-out record."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """0: greedy answers; above 0: sampled at this temperature."""
    max_tokens: Optional[int] = Field(None, ge=1, le=131072)
    """Completion length cap; null: rollout.max_completion_length."""
    max_records: Optional[int] = Field(None, ge=1)
    """Evaluate only the first this many held-out records (null: all)."""
    engine: Literal["hf", "vllm"] = "hf"
    """What answers the held-out records in `streamgrpo eval` and the evaluator: `hf` (transformers) or `vllm` (much faster for a large model on a GPU; rollout.vllm's settings, its gpu_memory_utilization counted in the placement; a LoRA adapter must be merged first)."""
    batch_size: int = Field(8, ge=1, le=1024)
    """Prompts generated together."""
    shuffle_frames: bool = False
    """Also answer every record with each video's frames in a random order, and report the ordered and shuffled accuracy per question kind and their drop (how much the model relies on frame order)."""
    shuffle_seed: int = Field(0, ge=0)
    """Seed of the frame orders for shuffle_frames (per record: the same order at every version)."""
    by_kind: dict[str, str] = Field(default_factory=lambda: {"regression": "mra"})
    """How `eval` and the evaluator score these question kinds with the `accuracy` reward, over its training `by_kind` (default: regression by VSI-Bench's mean relative accuracy, as Video-R1 reports it); {}: as in training."""
