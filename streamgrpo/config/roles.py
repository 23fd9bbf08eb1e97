"""Each role sees its sections: the generator, the evaluator and the relay run on a view of the config that holds
only the sections they read, and the few values they take from the learner's section, under names that say what
the role does with them (as PRIME-RL's shared config writes one value into each role's config). A role that
reads any other section fails with ``AttributeError: '<Role>Config' object has no attribute '<section>'`` in
every test that runs it. The learner, which reads nearly every section, takes the whole :class:`Config`.

The views share the config's section objects (no copy, no second validation): made once at the top of a role's
loop from the whole config (``GeneratorConfig.of(cfg)``; a view passes through).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from streamgrpo.config.data import DataConfig
from streamgrpo.config.evaluation import EvalConfig
from streamgrpo.config.metrics import MetricsConfig
from streamgrpo.config.model import ModelConfig
from streamgrpo.config.queue import QueueConfig
from streamgrpo.config.rewards import RewardsConfig
from streamgrpo.config.rollout import RolloutConfig
from streamgrpo.config.schema import Config
from streamgrpo.config.weights import WeightsConfig


def final_version(cfg: Config) -> int:
    """The last version a run publishes: the learner's version counts its steps, and it publishes every
    ``weights.sync_every``-th, up to ``learner.max_steps``."""
    return cfg.learner.max_steps - cfg.learner.max_steps % cfg.weights.sync_every


class RoleConfig(BaseModel):
    """What every role's view holds besides its sections."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    run_dir: str
    seed: int

    @classmethod
    def derived(cls, cfg: Config) -> dict[str, Any]:
        """The values this role takes from sections it does not see (none by default)."""
        return {}

    @classmethod
    def of(cls, cfg: Config | RoleConfig):
        """This role's view of ``cfg`` (a view of this role passes through)."""
        if isinstance(cfg, cls):
            return cfg
        own = {name: getattr(cfg, name) for name in cls.model_fields if name in type(cfg).model_fields}
        return cls.model_construct(**own, **cls.derived(cfg))


class GeneratorConfig(RoleConfig):
    """``run_generator``'s view: it samples (model, data, rollout), scores (rewards), sends (queue), takes weights
    (weights) and serves metrics."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    queue: QueueConfig
    weights: WeightsConfig
    metrics: MetricsConfig
    custom_mask: bool = False
    """``learner.shared_prompt``: the model's attention takes the learner's custom mask, so that both compute the
    same log-probs."""
    sync_groups_per_step: int = 1
    """``learner.groups_per_step``: under ``rollout.sync``, the groups produced at each weight version."""

    @classmethod
    def derived(cls, cfg: Config) -> dict[str, Any]:
        return {"custom_mask": cfg.learner.shared_prompt, "sync_groups_per_step": cfg.learner.groups_per_step}


class EvaluatorConfig(RoleConfig):
    """``run_evaluator``'s view: it answers held-out records (model, data, rollout's device and lengths), scores
    them (rewards, eval) at the versions it receives (weights) and serves metrics."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    eval: EvalConfig
    weights: WeightsConfig
    metrics: MetricsConfig
    custom_mask: bool = False
    """``learner.shared_prompt``: the model loads as the learner's and the generators' do."""
    final_version: int = 0
    """The run's last published version (``learner.max_steps`` rounded down to ``weights.sync_every``): always
    evaluated."""

    @classmethod
    def derived(cls, cfg: Config) -> dict[str, Any]:
        return {"custom_mask": cfg.learner.shared_prompt, "final_version": final_version(cfg)}


class RelayConfig(RoleConfig):
    """``run_relay``'s view: it forwards weight versions (weights) and serves metrics."""

    weights: WeightsConfig
    metrics: MetricsConfig
