"""Seed-era config names (TRL / R1-V / Video-R1 arguments) and where they live in streamgrpo's config.

Pure data; :func:`streamgrpo.config.build_config` applies them with a one-line notice each. :data:`MOVED`
lists keys that moved between the core's sections (a recipe lists the keys that moved into its own section:
:mod:`streamgrpo.config.recipes`).
"""

from __future__ import annotations

# Seed-era flat names (TRL / R1-V / Video-R1 argument names) -> our dotted keys.
ALIASES: dict[str, str] = {
    "grpo_beta": "loss.beta",
    "beta": "loss.beta",
    "epsilon": "loss.epsilon",
    "epsilon_high": "loss.epsilon_high",
    "loss_type": "loss.loss_type",
    "scale_rewards": "loss.scale_rewards",
    "max_staleness": "learner.max_staleness",
    "grpo_sample_size": "rollout.num_generations",
    "num_generations": "rollout.num_generations",
    "generation_temperature": "rollout.temperature",
    "temperature": "rollout.temperature",
    "generation_top_p": "rollout.top_p",
    "top_p": "rollout.top_p",
    "max_completion_length": "rollout.max_completion_length",
    "tune_mm_llm": "model.tune_mm_llm",
    "tune_mm_mlp": "model.tune_mm_mlp",
    "tune_mm_vision": "model.tune_mm_vision",
    "model_name_or_path": "model.name_or_path",
    "learning_rate": "learner.learning_rate",
    "weight_decay": "learner.weight_decay",
    "warmup_steps": "learner.warmup_steps",
    "max_grad_norm": "learner.max_grad_norm",
    "max_steps": "learner.max_steps",
    "gradient_checkpointing": "learner.gradient_checkpointing",
    "bf16": "learner.bf16",
    "save_steps": "learner.save_steps",
    "save_total_limit": "learner.save_total_limit",
    "deepspeed": "learner.deepspeed_config",
    "num_train_epochs": "rollout.num_epochs",
    "output_dir": "run_dir",
    "fps": "data.fps",
    "min_frames": "data.min_frames",
    "max_frames": "data.max_frames",
    "min_pixels": "data.min_pixels",
    "max_pixels": "data.max_pixels",
    "total_pixels": "data.total_pixels",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
}
# Keys that moved to another section: old dotted key -> new one (loaded with a one-line notice).
MOVED: dict[str, str] = {
    "loss.max_staleness": "learner.max_staleness",  # only the learner's intake reads it
}
# Seed-era reward weights: they set the weight of the named reward function.
REWARD_WEIGHT_ALIASES = {"format_reward_weight": "format", "accuracy_reward_weight": "accuracy"}
