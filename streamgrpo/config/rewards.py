"""The ``rewards`` section: which reward functions, their weights and parameters."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from streamgrpo.sections import Section


class RewardSpec(Section):
    name: str
    """Built-in reward name (format, accuracy, numeric, ...) or `module:function` for a custom one."""
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Weight in the total reward (total = sum of weight * value)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword parameters passed to the reward factory."""


class RewardsConfig(Section):
    functions: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="format", weight=0.3), RewardSpec(name="accuracy", weight=0.7)]
    )
    """Reward functions and weights; the message keeps every value and the weighted total."""
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """A reward call slower than this scores 0 for its completions and counts an error."""
    debug_log: Optional[str] = None
    """Append one JSON line per completion (prompt id, text, each reward, total, ground truth) here."""

    @model_validator(mode="before")
    @classmethod
    def _accept_list(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {"functions": value}
        return value
