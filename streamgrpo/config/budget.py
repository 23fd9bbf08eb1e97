"""How many bytes Redis holds for a run: the sizing rule, from the config alone (pure).

Exactly-once keeps every trained group's message in Redis until the checkpoint that commits it, and
producers may queue ``queue.max_pending`` more, so Redis holds up to
``((learner.save_steps + 2) x learner.groups_per_step + queue.max_pending) x message bytes`` (the two
steps: the one being collected and the next one, read ahead while a step trains; with
``learner.async_checkpoint`` (any backend, any number of ranks), ``2 x save_steps``: a checkpoint's groups
are held until its background write ends on every rank). A message is
dominated by its pixels when visuals travel inline (``data.total_pixels x 3`` bytes at most) and by
its completions when they travel by reference (``rollout.media``). Size ``maxmemory`` at least 1.25x
the estimate (Redis' own overhead, fragmentation).
"""

from __future__ import annotations

from typing import Protocol

from streamgrpo.config.data import DataConfig
from streamgrpo.config.learner import LearnerConfig
from streamgrpo.config.queue import QueueConfig
from streamgrpo.config.rollout import RolloutConfig


class Sections(Protocol):
    """The sections the sizing rule reads (a :class:`streamgrpo.config.schema.Config` is one; this
    module sits below the schema, which asks it for advice)."""

    rollout: RolloutConfig
    data: DataConfig
    learner: LearnerConfig
    queue: QueueConfig


ADVICE_BYTES = 8 << 30  # beyond this many held bytes, Config.advice() says so
HEADROOM = 1.25
_PER_TOKEN = 4 + 4 + 4 + 4  # token id, behaviour log-prob, policy version (int32/float32/int32), ~4 bytes of text
_PATCH_AREA = 28 * 28  # pixels per visual token (Qwen2.5-VL; Qwen3-VL's 32 x 32 gives fewer tokens)


def message_bytes(cfg: Sections) -> int:
    """Upper estimate of one group's wire message: completions, prompt ids, and the pixels (inline)
    or the references (``rollout.media: reference``)."""
    r, d = cfg.rollout, cfg.data
    completions = r.num_generations * (r.max_completion_length * _PER_TOKEN + 256)
    prompt = (d.total_pixels // _PATCH_AREA) * 4 + 4 * 4096  # visual tokens, and the question text's
    visuals = d.total_pixels * 3 if r.media == "inline" else 1024 + 4 * d.max_frames
    return completions + prompt + visuals + 2048


def uncommitted_steps(cfg: Sections) -> int:
    """Steps whose groups Redis may hold uncommitted: ``save_steps``, twice that with
    ``learner.async_checkpoint`` (torch or DeepSpeed, one rank or many: a checkpoint's groups are committed
    once every rank's background write has ended, while the next window trains)."""
    return cfg.learner.save_steps * (2 if cfg.learner.async_checkpoint else 1)


def held_groups(cfg: Sections) -> int:
    """Groups Redis may hold at once: the uncommitted window, the step being collected and the next one
    read ahead, and the producers' backlog."""
    return (uncommitted_steps(cfg) + 2) * cfg.learner.groups_per_step + cfg.queue.max_pending


def held_bytes(cfg: Sections) -> int:
    return held_groups(cfg) * message_bytes(cfg)


def describe(cfg: Sections) -> str:
    """``~N GiB (G groups of up to M MiB, visuals <media>)``."""
    window = "2 x save_steps (async_checkpoint)" if uncommitted_steps(cfg) != cfg.learner.save_steps else "save_steps"
    return (f"~{held_bytes(cfg) / 2**30:.1f} GiB ({held_groups(cfg)} groups: ({window} + 2) x groups_per_step "
            f"+ max_pending, of up to {message_bytes(cfg) / 2**20:.2f} MiB each, visuals {cfg.rollout.media})")


def redis_budget_warning(cfg: Sections, maxmemory: int) -> str | None:
    """One line when Redis' ``maxmemory`` (0: no limit) is below what the run may hold, with headroom."""
    need = held_bytes(cfg) * HEADROOM
    if not maxmemory or maxmemory >= need:
        return None
    fix = "rollout.media: reference, " if cfg.rollout.media == "inline" else ""
    return (f"Redis maxmemory {maxmemory / 2**30:.1f} GiB is below what this run may hold, {describe(cfg)}, "
            f"plus {HEADROOM - 1:.0%} headroom: the learner will checkpoint early when Redis fills; raise "
            f"maxmemory, or use {fix}a smaller learner.save_steps or queue.max_pending")
