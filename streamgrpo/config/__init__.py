"""One pydantic config for every streamgrpo process (``from streamgrpo.config import Config, load_config``).

One YAML document with the sections ``model``, ``data``, ``rollout``, ``rewards``, ``loss``,
``learner``, ``queue``, ``weights`` and ``metrics`` (plus ``run_dir`` and ``seed``), each defined in
its own module here; the root and its cross-section checks are :mod:`.schema`, reading files and
overrides is :mod:`.loading`, seed-era names are :mod:`.aliases`, masking secrets is :mod:`.redact`.
Unknown keys are errors naming the key, value and file.
"""

from streamgrpo.config.aliases import ALIASES, REWARD_WEIGHT_ALIASES
from streamgrpo.config.data import DataConfig
from streamgrpo.config.evaluation import EvalConfig
from streamgrpo.config.launch import LaunchConfig
from streamgrpo.config.learner import LearnerConfig
from streamgrpo.config.loading import build_config, find_config, load_config, parse_override, shipped_configs
from streamgrpo.config.loss import LossConfig
from streamgrpo.config.metrics import MetricsConfig, WandbConfig
from streamgrpo.config.model import LoraConfig, ModelConfig
from streamgrpo.config.queue import QueueConfig
from streamgrpo.config.rewards import RewardsConfig, RewardSpec
from streamgrpo.config.rollout import RolloutConfig, TemporalContrastConfig, VllmConfig
from streamgrpo.config.schema import SECTIONS, Config
from streamgrpo.config.weights import WeightsConfig
from streamgrpo.sections import ConfigError

__all__ = [
    "ALIASES", "REWARD_WEIGHT_ALIASES", "SECTIONS", "Config", "ConfigError", "DataConfig", "EvalConfig", "LaunchConfig", "LearnerConfig", "LossConfig", "LoraConfig", "MetricsConfig",
    "ModelConfig", "QueueConfig", "RewardSpec", "RewardsConfig", "RolloutConfig", "TemporalContrastConfig",
    "VllmConfig", "WandbConfig", "WeightsConfig", "build_config", "find_config", "load_config", "parse_override",
    "shipped_configs",
]
