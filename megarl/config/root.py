"""The whole job's config, its Hydra registration, and the DictConfig → dataclass conversion.

`main` turns Hydra's DictConfig into a `MegarlConfig` once (`to_config`); everything after that
receives typed dataclasses, never a DictConfig.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megarl.assets import asset_path
from megarl.config.agents import AgentsConfig
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.async_training import AsyncTrainingConfig
from megarl.config.data import DataConfig
from megarl.config.model import ModelConfig
from megarl.config.plan import PlanConfig
from megarl.config.reward import RewardModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.sft import SFTConfig
from megarl.config.sync import SyncConfig
from megarl.config.trainer import RewardConfig, TrainerConfig
from megarl.config.training import ActorConfig, CriticConfig, RefConfig

SCHEMA_NAME = "megarl_schema"


@dataclass(kw_only=True, slots=True)
class MegarlConfig:
    model: ModelConfig
    """The HF architecture trained and served."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and lengths."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (PPO with GAE)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (KL)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    agents: AgentsConfig = field(default_factory=AgentsConfig)
    """Agents outside megarl's loop API (the OpenAI-compatible endpoint)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync from the actor to the rollout replicas."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, losses, KL."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Model rewards: a discriminative RM, a generative judge, a remote reward service."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (trainer.mode=sft): the chat dataset's columns, lengths, the HF export."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Devices, run length, checkpoints, logging."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Asynchronous off-policy training (separate pools)."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Device memory and bandwidths that `megarl-plan` checks the layout against."""


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore and the `${asset:NAME}` resolver (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=MegarlConfig)
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda name: str(asset_path(name)))


def to_config(cfg: DictConfig) -> MegarlConfig:
    """Resolve interpolations and build the typed config (Hydra's own `hydra` node is dropped)."""
    merged = OmegaConf.merge(OmegaConf.structured(MegarlConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, MegarlConfig)
    return obj
