"""Typed configs (one dataclass per component), their Hydra registration and each group's own checks.

The checks across groups, and the facts derived from a config, live on the driver side: `megarl.plan.gate`
and `megarl.plan.facts`.
"""

from megarl.config.algorithm import AlgorithmConfig, FilterGroupsConfig, KLControlConfig
from megarl.config.data import DataConfig
from megarl.config.layout import ConfigError
from megarl.config.model import ModelConfig
from megarl.config.rollout import MultiTurnConfig, RolloutConfig, SamplingConfig
from megarl.config.root import SCHEMA_NAME, MegarlConfig, register_configs, to_config
from megarl.config.trainer import RewardConfig, TrainerConfig
from megarl.config.training import ActorConfig, CriticConfig, MegatronConfig, OptimConfig, RefConfig

__all__ = [
    "SCHEMA_NAME",
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "MegarlConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "TrainerConfig",
    "register_configs",
    "to_config",
]
