"""The ``demo`` section: the knobs of the CPU demo and the benchmarks built on it.

The core never reads them: the demo recipe makes its data and its warm-started tiny model from them
(:mod:`.assets`), and the staleness benchmark slows the generators' weight applier with
``weight_apply_delay``. Before this section existed they were ``model.tiny_if_missing``,
``model.warm_pixels``, ``model.warm_letters``, ``data.make_demo_if_missing``, ``data.demo_size``,
``data.demo_motion`` and ``rollout.weight_apply_delay``; those keys still load, with a one-line
notice (:data:`streamgrpo.config.aliases.MOVED`).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class DemoConfig(Section):
    task: Literal["clips", "needle"] = "clips"
    """Which synthetic data set demo.make_data makes: `clips` (the colour and motion demos' short clips of a moving square) or `needle` (streamgrpo/recipes/needle: demo.frames-frame videos where one coloured square flashes for 4-8 frames; `demo-needle`)."""
    frames: int = Field(256, ge=8, le=4096)
    """Frames per video of the `needle` data set."""
    make_data: bool = False
    """Create the synthetic demo data set in data.train_path's directory when data.train_path does not exist."""
    size: int = Field(2000, ge=10, le=1_000_000)
    """Records in that synthetic data set."""
    motion: Literal["mirror", "reverse"] = "mirror"
    """`reverse` makes every left/up clip its right/down twin played backwards (the same frames, so only their order tells the direction); `mirror` mirrors it."""
    tiny_model: bool = False
    """When model.name_or_path does not exist, build a tiny random Qwen2.5-VL there and teach it the answer format."""
    warm_pixels: Optional[int] = Field(None, ge=28 * 28, le=16384 * 28 * 28)
    """Pixels per frame for that format warm start (its data.min_pixels and max_pixels); null: the data section's. The warm-up only teaches the format, and `demo-motion` warms its 56x56 clips at their own size while training at 112x112 (README)."""
    warm_letters: Literal["uniform", "marginal"] = "uniform"
    """How that format warm start treats the option letter: `uniform` makes every prompt's answer flat over its
    options; `marginal` only makes every option as frequent on average, so a prompt's answer can still depend on
    its video (on the motion demo it sped up learning with labels, not GRPO; README)."""
    weight_apply_delay: int = Field(0, ge=0, le=1000)
    """Staleness benchmark: generators apply a received weight version this many versions late (forces staleness)."""
