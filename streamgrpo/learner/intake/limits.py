"""How big a group the learner takes: ``learner.max_group_pixels`` and ``learner.max_group_tokens``.

Checked on the message as decoded from the wire, before any referenced visual is decoded: a visual by
reference declares its frame indices and its size (``ref.height x ref.width``), an inline one carries its
frames. A group past either limit is dead-lettered as ``too_large`` (one line, counted in
``groups_dropped{reason=too_large}``) instead of making one step take minutes or the learner run out of
memory (a learner that dies on a group reads it again after every restart: see :mod:`.crash_loop`).

Defaults (null) come from the config's own data limits, so a group that follows them always passes:

* pixels: ``data.total_pixels`` (the budget of one sample), capped by what the group's visuals may hold
  each (a video ``data.max_frames x data.max_pixels``, an image ``data.max_pixels``);
* tokens: ``rollout.num_generations x (P + rollout.max_completion_length)``, ``P`` the longest prompt the
  data allows: ``data.total_pixels / 784`` visual tokens (the fewest pixels per token of the Qwen-VL
  models: a 28 x 28 image patch) + ``data.max_question_chars`` + :data:`TEMPLATE_TOKENS`.

Records whose ``meta`` raises ``max_frames``, ``max_pixels`` or ``total_pixels`` need the keys set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamgrpo.wire import ScoredGroup, Visual

PIXELS_PER_TOKEN = 28 * 28
"""The fewest pixels one visual token covers among the supported models (a Qwen2.5-VL image token)."""
TEMPLATE_TOKENS = 1024
"""Prompt tokens besides the question and the visuals: chat template, system prompt, tags."""


@dataclass(frozen=True)
class GroupLimits:
    """The learner's limits: ``pixels`` None derives the cap from each group's visuals (module docstring)."""

    pixels: int | None
    tokens: int
    total_pixels: int
    video_pixels: int
    image_pixels: int

    @classmethod
    def from_config(cls, cfg: Any) -> GroupLimits:
        d, r, lc = cfg.data, cfg.rollout, cfg.learner
        tokens = lc.max_group_tokens
        if tokens is None:
            prompt = d.total_pixels // PIXELS_PER_TOKEN + d.max_question_chars + TEMPLATE_TOKENS
            tokens = r.num_generations * (prompt + r.max_completion_length)
        return cls(pixels=lc.max_group_pixels, tokens=int(tokens), total_pixels=d.total_pixels,
                   video_pixels=d.max_frames * d.max_pixels, image_pixels=d.max_pixels)

    def pixel_cap(self, group: ScoredGroup) -> int:
        """The pixels ``group`` may hold: the set limit, or the data config's for its visuals."""
        if self.pixels is not None:
            return self.pixels
        per = sum(self.video_pixels if v.kind == "video" else self.image_pixels for v in group.visuals)
        return min(self.total_pixels, per)


def visual_pixels(v: Visual) -> int:
    """Pixels of one visual as its message declares them (no decoding): frames x height x width."""
    if v.frames is not None:
        shape = tuple(v.frames.shape)
        return int(shape[0]) * int(shape[1]) * int(shape[2]) if len(shape) >= 3 else 0
    if v.ref is None:
        return 0
    count = len(v.frame_indices) if v.kind == "video" else 1
    return count * int(v.ref.height) * int(v.ref.width)


def group_pixels(group: ScoredGroup) -> int:
    """Pixels of every visual of ``group``, summed."""
    return sum(visual_pixels(v) for v in group.visuals)


def group_tokens(group: ScoredGroup) -> int:
    """Decoder tokens the step processes for ``group``: its prompt once per completion, plus completions."""
    prompt = len(group.prompt_ids)
    return sum(prompt + len(c.token_ids) for c in group.completions)


def too_large(group: ScoredGroup, limits: GroupLimits) -> str | None:
    """Why ``group`` is over the learner's limits (one line), or None."""
    pixels, cap = group_pixels(group), limits.pixel_cap(group)
    if pixels > cap:
        src = "learner.max_group_pixels" if limits.pixels is not None else "the data config's limits"
        return (f"{pixels:,} pixels in {len(group.visuals)} visual(s), over {cap:,} ({src}; "
                "set learner.max_group_pixels to take it)")
    tokens = group_tokens(group)
    if tokens > limits.tokens:
        return (f"{tokens:,} tokens ({len(group.completions)} completions of a {len(group.prompt_ids):,}-token "
                f"prompt), over learner.max_group_tokens {limits.tokens:,}")
    return None
