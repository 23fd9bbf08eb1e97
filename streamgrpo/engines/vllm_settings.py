"""vLLM's memory-shaping settings derived from the data limits, so a long-video config starts untuned (pure).

vLLM reserves KV cache for ``max_model_len`` tokens (null: the model's own length, 128k for Qwen2.5-VL,
256k for Qwen3-VL, more than a GPU beside the policy may hold), profiles its vision encoder with the
largest visual ``limit_mm_per_prompt`` allows, and prefills at most ``max_num_batched_tokens`` tokens a
step. Each follows from what a prompt of this config can hold:

* visual tokens of one prompt: every video at ``data.max_frames`` frames of ``data.max_pixels`` (a token
  per ``factor x factor`` pixels per ``temporal_patch`` frames: 28 x 28 x 2 for Qwen2.5-VL, 32 x 32 x 2 for
  Qwen3-VL) and every image at ``data.max_pixels``, the most videos and images of any record, at most
  ``data.total_pixels / factor^2`` over all; plus :data:`TOKENS_PER_FRAME_GROUP` per frame group (vision
  start/end, Qwen3-VL's timestamps);
* text: the longest question and ``data.system_prompt`` in characters (a token is at least one
  character) and :data:`TEMPLATE_TOKENS` for the chat template and the format instruction;
* ``max_model_len`` = that prompt + ``rollout.max_completion_length``, rounded up to
  :data:`ROUND`, at most the model's own length;
* ``max_num_batched_tokens``: at least vLLM's usual :data:`MIN_BATCHED_TOKENS` and one whole video (its
  placeholder tokens prefill in one step, the encoder output not held over several), at most
  ``max_model_len``;
* ``limit_mm_per_prompt``: the most videos/images of any record, profiled at ``max_frames`` frames of the
  largest side ``max_pixels`` allows (:func:`mm_limits`);
* ``enable_prefix_caching`` is the config's (on by default: the G samples of a group and T-GRPO's
  contrast share the prompt's KV).

Settings given in ``rollout.vllm`` win: each derived value is used only where the config leaves it null.
Records whose ``meta`` raises ``max_frames``, ``max_pixels`` or ``total_pixels`` past the data config need
``max_model_len`` set (as the learner's group limits do, ``streamgrpo/learner/intake/limits.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TEMPLATE_TOKENS = 1024
"""Prompt tokens besides the question and the visuals (chat template, system prompt, tags): the learner's
allowance for the same (``streamgrpo/learner/intake/limits.py``)."""
TOKENS_PER_FRAME_GROUP = 8
"""Text tokens a video adds per temporal group besides its visual tokens (Qwen3-VL's ``<t seconds>``
timestamp, about 6), and per visual its vision start/end: an upper bound."""
MIN_BATCHED_TOKENS = 8192
"""vLLM's own default prefill budget per step for an offline ``LLM`` on a large GPU."""
ROUND = 256
"""max_model_len is rounded up to a multiple of this (vLLM's KV blocks are 16 tokens)."""
FALLBACK_MODEL_LEN = 128_000
"""The cap when the model's own length is unknown: the shortest among the supported Qwen-VL models."""


@dataclass(frozen=True)
class DataShape:
    """What one prompt of this config may hold (from the data config and the records)."""

    max_frames: int
    max_pixels: int
    total_pixels: int
    videos: int  # most videos of any record
    images: int  # most images of any record
    question_chars: int  # longest question and the system prompt, in characters
    completion_tokens: int  # rollout.max_completion_length
    factor: int = 28  # pixels per visual token side (patch x merge)
    temporal_patch: int = 2


def record_shape(counts: Iterable[tuple[int, int]], question_chars: Iterable[int], *, data, rollout,
                 factor: int = 28, temporal_patch: int = 2) -> DataShape:
    """A :class:`DataShape` from the (videos, images) count and the question length of every record (none
    given: ``data.max_question_chars``) and the ``data``/``rollout`` config sections."""
    n_vid = n_img = 0
    for v, i in counts:
        n_vid, n_img = max(n_vid, int(v)), max(n_img, int(i))
    chars = max(question_chars, default=int(data.max_question_chars)) + len(data.system_prompt or "")
    return DataShape(max_frames=int(data.max_frames), max_pixels=int(data.max_pixels), total_pixels=int(data.total_pixels),
                     videos=n_vid, images=n_img, question_chars=int(chars),
                     completion_tokens=int(rollout.max_completion_length), factor=int(factor),
                     temporal_patch=int(temporal_patch))


def video_tokens(s: DataShape) -> int:
    """Visual tokens of one video at the data limits (``max_frames`` frames of ``max_pixels``)."""
    groups = math.ceil(s.max_frames / s.temporal_patch)
    return groups * (s.max_pixels // (s.factor * s.factor))


def prompt_tokens(s: DataShape) -> int:
    """An upper bound on one prompt's tokens (module docstring)."""
    per_token = s.factor * s.factor
    visual = s.videos * video_tokens(s) + s.images * (s.max_pixels // per_token)
    visual = min(visual, math.ceil(s.total_pixels / per_token))
    extra = s.videos * (math.ceil(s.max_frames / s.temporal_patch) * TOKENS_PER_FRAME_GROUP) \
        + s.images * TOKENS_PER_FRAME_GROUP
    return visual + extra + s.question_chars + TEMPLATE_TOKENS


def mm_limits(counts: Iterable[tuple[int, int]], *, max_frames: int, max_pixels: int,
              factor: int = 28) -> dict[str, dict[str, int]]:
    """``limit_mm_per_prompt`` from the (videos, images) count of every record: the largest counts,
    with the profiling sizes bounded by the data config (``max_frames``, ``max_pixels``)."""
    n_vid = n_img = 0
    for v, i in counts:
        n_vid, n_img = max(n_vid, int(v)), max(n_img, int(i))
    side = max(factor, int(math.isqrt(int(max_pixels)) // factor * factor))
    return {"video": {"count": n_vid, "num_frames": int(max_frames), "width": side, "height": side},
            "image": {"count": n_img, "width": side, "height": side}}


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def derive(s: DataShape, *, model_max_len: int | None) -> dict[str, Any]:
    """The derived ``max_model_len``, ``max_num_batched_tokens`` and ``limit_mm_per_prompt`` (module docstring)."""
    cap = int(model_max_len) if model_max_len else FALLBACK_MODEL_LEN
    max_len = min(_round_up(prompt_tokens(s) + s.completion_tokens, ROUND), cap)
    one_video = video_tokens(s) + math.ceil(s.max_frames / s.temporal_patch) * TOKENS_PER_FRAME_GROUP \
        if s.videos else 0
    batched = min(max(MIN_BATCHED_TOKENS, _round_up(one_video, ROUND)), max_len)
    limits = mm_limits([(s.videos, s.images)], max_frames=s.max_frames, max_pixels=s.max_pixels, factor=s.factor)
    return {"max_model_len": max_len, "max_num_batched_tokens": batched, "limit_mm_per_prompt": limits}


def settings(derived: Mapping[str, Any], *, max_model_len: int | None = None,
             max_num_batched_tokens: int | None = None,
             limit_mm_per_prompt: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``derived`` with every setting the user gave (not None) in its place: explicit settings win. A derived
    ``max_num_batched_tokens`` never exceeds a user's ``max_model_len``."""
    out = dict(derived)
    for key, given in (("max_model_len", max_model_len), ("max_num_batched_tokens", max_num_batched_tokens),
                       ("limit_mm_per_prompt", limit_mm_per_prompt)):
        if given is not None:
            out[key] = dict(given) if isinstance(given, Mapping) else given
    if max_num_batched_tokens is None and out.get("max_model_len") is not None \
            and out.get("max_num_batched_tokens") is not None:
        out["max_num_batched_tokens"] = min(out["max_num_batched_tokens"], out["max_model_len"])
    return out


def model_max_len(hf_config: Any) -> int | None:
    """The model's own context length from its (transformers) config: ``max_position_embeddings`` of the text
    config, else of the config itself; None when neither says."""
    for cfg in (getattr(hf_config, "text_config", None), hf_config):
        n = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None
