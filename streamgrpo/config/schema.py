"""The root of the config: one pydantic model with a field per section (each core section in its own
module of this package, each installed recipe's section from its entry point: :mod:`.recipes`), the
checks that span sections, and advice on settings that work against each other. No torch here: the
CLI loads configs before importing it."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from streamgrpo.config.budget import ADVICE_BYTES, describe, held_bytes
from streamgrpo.config.data import DataConfig
from streamgrpo.config.deepspeed_files import compile_refusal, shipped_zero_stage
from streamgrpo.config.evaluation import EvalConfig
from streamgrpo.config.launch import LaunchConfig
from streamgrpo.config.learner import LearnerConfig
from streamgrpo.config.loss import LossConfig
from streamgrpo.config.metrics import MetricsConfig
from streamgrpo.config.model import ModelConfig
from streamgrpo.config.queue import QueueConfig
from streamgrpo.config.recipes import load_recipes
from streamgrpo.config.rewards import RewardsConfig
from streamgrpo.config.rollout import RolloutConfig
from streamgrpo.config.weights import WeightsConfig


class CoreConfig(BaseModel):
    """The core's sections; :data:`Config` adds the installed recipes' (their hooks: :mod:`.recipes`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    run_dir: str = "runs/latest"
    """Run directory: logs, metrics.jsonl, checkpoints, summary and plots."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed for sampling, shuffling and initialisation."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """The evaluator (`streamgrpo evaluator`): held-out accuracy at the learner's weight versions, while it trains."""

    @field_validator("run_dir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _checkpointing_knobs(self) -> CoreConfig:
        lc = self.learner
        if (lc.checkpoint_every > 1 or lc.checkpoint_offload or lc.checkpoint_matmuls) and not lc.gradient_checkpointing:
            knob = ("checkpoint_every" if lc.checkpoint_every > 1 else
                    "checkpoint_offload" if lc.checkpoint_offload else "checkpoint_matmuls")
            raise ValueError(f"learner.{knob} applies to recomputed layers: set learner.gradient_checkpointing to "
                             "true, or leave it out")
        return self

    @model_validator(mode="after")
    def _compile_where_it_works(self) -> CoreConfig:
        lc = self.learner
        if lc.compile and lc.backend == "deepspeed":  # a path's stage: at learner start (learner/deepspeed_setup.py)
            stage = shipped_zero_stage(lc.deepspeed_config)
            refusal = compile_refusal(stage, lc.deepspeed_config) if stage is not None else None
            if refusal:
                raise ValueError(refusal)
        if lc.compile and lc.checkpoint_offload:
            raise ValueError("learner.compile does not compile the saved-input offload of learner.checkpoint_offload: "
                             "set one of them to false")
        lora = self.model.lora
        # inductor's code for a GPU (a CPU learner compiled it, torch 2.14; aot_eager generates no code)
        on_gpu = lc.compile_backend == "inductor" and lc.device != "cpu"
        if lc.compile and on_gpu and lc.gradient_checkpointing and lora is not None and lora.dropout > 0:
            raise ValueError(f"learner.compile with model.lora.dropout {lora.dropout} in recomputed layers: inductor "
                             "cannot replay the dropout in the recompute (BackendCompilerFailed on CUDA, torch 2.11): "
                             "set model.lora.dropout to 0, or learner.compile to false")
        return self

    @model_validator(mode="after")
    def _sync_is_on_policy(self) -> CoreConfig:
        if self.rollout.sync and self.learner.max_staleness:  # on-policy: every group at the learner's version
            self.learner.max_staleness = 0
        return self

    @model_validator(mode="after")
    def _shared_prompt_attention(self) -> CoreConfig:
        if self.learner.shared_prompt and self.model.attn_implementation == "flash_attention_2":
            raise ValueError("learner.shared_prompt needs a custom attention mask: set model.attn_implementation "
                             "to sdpa or eager, or learner.shared_prompt to false")
        return self

    @model_validator(mode="after")
    def _relay_port_is_its_own(self) -> CoreConfig:
        port = self.weights.relay_metrics_port
        if port and self.metrics.port and 0 <= port - self.metrics.port < max(1, self.rollout.num_generators):
            raise ValueError(f"weights.relay_metrics_port {port} is a generator's metrics port (metrics.port "
                             f"{self.metrics.port} + local index): set it to 0 (a free port) or outside that range")
        return self

    @model_validator(mode="after")
    def _evaluator_needs_records(self) -> CoreConfig:
        if self.eval.enabled and not self.data.eval_path:
            raise ValueError("eval.enabled needs held-out records: set data.eval_path, or eval.enabled to false")
        return self

    def advice(self) -> list[str]:
        """Settings that are valid but work against each other: one line each, for a startup warning."""
        if held_bytes(self) <= ADVICE_BYTES:
            return []
        return [f"Redis may hold {describe(self)}: trained groups stay there until the checkpoint that commits them "
                "(exactly-once training); size its maxmemory for that, or lower learner.save_steps"
                + (", or send visuals by reference (rollout.media: reference)" if self.rollout.media == "inline" else "")]

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """The config as plain data; ``redact`` masks secrets (:func:`streamgrpo.config.redact.redact_secrets`)."""
        tree = self.model_dump(mode="json")
        if redact:
            from streamgrpo.config.redact import redact_secrets

            tree = redact_secrets(tree)
        return tree

    def to_yaml(self, redact: bool = False) -> str:
        return yaml.safe_dump(self.to_dict(redact), sort_keys=False)


CORE_SECTIONS = ("model", "data", "rollout", "rewards", "loss", "learner", "queue", "weights", "metrics", "launch",
                 "eval")
RECIPES = load_recipes(CORE_SECTIONS)
Config = create_model(
    "Config", __base__=CoreConfig, __module__=__name__,
    **{r.name: (r.section, Field(default_factory=r.section, description=r.doc)) for r in RECIPES})
Config.__doc__ = "The whole config: the core's sections and a section per installed recipe."
SECTIONS = CORE_SECTIONS + tuple(r.name for r in RECIPES)
