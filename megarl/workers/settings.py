"""What each role's ranks are told, built once on the driver from the config (`<Role>Settings.from_config`):
the model to build, the batching of their forward passes and updates, the loss settings, and for the actor how
its weights reach the engines. Workers never see the whole `MegarlConfig`.
"""

import dataclasses
from dataclasses import dataclass

from megarl.algo import estimator_traits
from megarl.config.algorithm import AlgorithmConfig
from megarl.config.lora import LoraConfig
from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.root import MegarlConfig
from megarl.config.sync import SyncConfig
from megarl.config.training import ActorConfig, MegatronConfig, OptimConfig, reference_replays_routing
from megarl.engines.replicas.launch import engine_dtype
from megarl.megatron.inputs import MicroBatching
from megarl.plan.facts import batch_sizes


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSettings:
    """`build_role`'s arguments: the model, its layout, where its weights come from, its optimizer."""

    model: ModelConfig
    megatron: MegatronConfig
    weights_path: str | None
    """None: `SeededInit`'s random init from `seed` (model.random_init)."""
    seed: int
    optim: OptimConfig | None = None
    """None: a frozen role (the reference)."""
    optimizer_steps: int = 1
    """Of the whole run: steps × mini-batches per step × epochs (the LR schedule's length)."""
    value_head: bool = False
    lora: LoraConfig | None = None
    """Adapters on the base (`actor.lora`, rank > 0): the base frozen, only they train."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSettings:
    """One role's update of a step: mini-batches, epochs and micro-batches over its DP shard."""

    mini_batches: int
    epochs: int
    shuffle: bool
    seed: int
    """The step's shuffle seed is seed + 1000 × step."""
    micro: MicroBatching
    norm_length: float
    """data.max_response_length: the seq-mean-token-sum-norm divisor."""
    max_skipped_steps: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSettings:
    """How the actor's weights reach the engines: their layout (rollout.*), the transport (sync.*), whether they
    share the actor's devices, and the dtype they serve."""

    rollout: RolloutConfig
    sync: SyncConfig
    placement: str
    engine_dtype: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorSettings:
    model: ModelSettings
    update: UpdateSettings
    log_prob_micro: MicroBatching
    temperature: float
    algorithm: AlgorithmConfig
    """The policy loss and its settings."""
    router_replay: str
    sync: SyncSettings

    @property
    def needs_sum_pi_squared(self) -> bool:
        """The advantage estimator reads Σπ² (the optimal token baseline)."""
        return "sum_pi_squared" in estimator_traits(self.algorithm.adv_estimator).needs

    @classmethod
    def from_config(cls, cfg: MegarlConfig, total_steps: int) -> "ActorSettings":
        a = cfg.actor
        update = _update(
            cfg, "actor", a.ppo_epochs, _micro(a, a.ppo_micro_batch_size_per_device), seed=cfg.trainer.seed
        )
        model = _model(cfg, a.megatron, cfg.trainer.seed, a.optim, update, total_steps)
        return cls(
            model=dataclasses.replace(model, lora=a.lora) if a.lora.enabled else model,
            update=update,
            log_prob_micro=_micro(a, a.log_prob_micro_batch_size_per_device or a.ppo_micro_batch_size_per_device),
            temperature=cfg.rollout.temperature if cfg.trainer.mode == "rl" else 1.0,
            algorithm=cfg.algorithm,
            router_replay=a.router_replay,
            sync=SyncSettings(
                rollout=cfg.rollout,
                sync=cfg.sync,
                placement=cfg.trainer.placement,
                engine_dtype=engine_dtype(cfg.rollout, cfg.model),
            ),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticSettings:
    model: ModelSettings
    update: UpdateSettings
    cliprange_value: float
    loss_agg_mode: str
    offload: bool
    """Leaves the device while colocated engines generate (critic.offload, colocated only)."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig, total_steps: int) -> "CriticSettings":
        c = cfg.critic
        micro = MicroBatching(c.ppo_micro_batch_size_per_device, c.use_dynamic_bsz, c.ppo_max_token_len_per_device)
        update = _update(cfg, "critic", c.ppo_epochs, micro, seed=cfg.trainer.seed + 500)
        model = _model(cfg, c.megatron, cfg.trainer.seed + 1, c.optim, update, total_steps, value_head=True)
        if c.model_path:
            model = dataclasses.replace(model, weights_path=c.model_path)
        return cls(
            model=model,
            update=update,
            cliprange_value=c.cliprange_value,
            loss_agg_mode=cfg.algorithm.loss_agg_mode,
            offload=c.offload and cfg.trainer.placement == "colocated",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceSettings:
    model: ModelSettings
    micro: MicroBatching
    temperature: float
    offload: bool
    """Leaves the device while colocated engines generate (ref.offload, colocated only)."""
    replays_routing: bool = False
    """Routes by the batch's `routed_experts` (the engines', under R3: `reference_replays_routing`)."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig) -> "ReferenceSettings":
        a = cfg.actor
        size = cfg.ref.log_prob_micro_batch_size_per_device or a.log_prob_micro_batch_size_per_device
        return cls(
            model=ModelSettings(
                model=cfg.model,
                megatron=cfg.ref.megatron or a.megatron,
                weights_path=None if cfg.model.random_init else cfg.model.path,
                seed=cfg.trainer.seed,
            ),
            micro=_micro(a, size or a.ppo_micro_batch_size_per_device),
            temperature=cfg.rollout.temperature,
            offload=cfg.ref.offload and cfg.trainer.placement == "colocated",
            replays_routing=reference_replays_routing(a),
        )


def _micro(a: ActorConfig, size: int) -> MicroBatching:
    return MicroBatching(size, a.use_dynamic_bsz, a.ppo_max_token_len_per_device)


def _update(cfg: MegarlConfig, role: str, epochs: int, micro: MicroBatching, *, seed: int) -> UpdateSettings:
    return UpdateSettings(
        mini_batches=batch_sizes(cfg, role).mini_batches_per_step,
        epochs=epochs,
        shuffle=cfg.actor.shuffle,
        seed=seed,
        micro=micro,
        norm_length=float(cfg.data.max_response_length),
        max_skipped_steps=cfg.trainer.max_skipped_steps,
    )


def _model(
    cfg: MegarlConfig,
    megatron: MegatronConfig,
    seed: int,
    optim: OptimConfig,
    update: UpdateSettings,
    total_steps: int,
    value_head: bool = False,
) -> ModelSettings:
    return ModelSettings(
        model=cfg.model,
        megatron=megatron,
        weights_path=None if cfg.model.random_init else cfg.model.path,
        seed=seed,
        optim=optim,
        optimizer_steps=total_steps * update.mini_batches * update.epochs,
        value_head=value_head,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardModelSettings:
    """The discriminative reward model (`reward_model.discriminative`, backend=megatron): a frozen value model built
    from an HF `*ForSequenceClassification` checkpoint, its value head loaded from `score.weight`."""

    model: ModelSettings
    micro: MicroBatching
    max_length: int
    """Tokens of a row the RM reads: longer rows keep their last max_length."""
    offload: bool
    """Leaves the device except while it scores (reward_model.discriminative.offload, colocated only: with separate
    pools nothing else needs the trainer's devices while the engines generate)."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig) -> "RewardModelSettings":
        rm = cfg.reward_model.discriminative
        assert rm.path is not None, "reward_model.discriminative.path is checked by the config's validation"
        model = ModelConfig(
            path=rm.path,
            tokenizer_path=rm.tokenizer_path,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        return cls(
            model=ModelSettings(
                model=model, megatron=rm.megatron, weights_path=rm.path, seed=cfg.trainer.seed, value_head=True
            ),
            micro=MicroBatching(rm.micro_batch_size),
            max_length=rm.max_length,
            offload=rm.offload and cfg.trainer.placement == "colocated",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class TeacherSettings:
    """The distillation teacher as a Megatron role (`algorithm.distillation.teacher`, backend=megatron): a frozen
    causal LM of its own checkpoint and layout that scores the student's sampled tokens."""

    model: ModelSettings
    micro: MicroBatching
    temperature: float
    """The rollout's, as the student's and the reference's log-probs are computed."""
    offload: bool
    """Leaves the device except while it scores (teacher.offload, colocated only)."""

    @classmethod
    def from_config(cls, cfg: MegarlConfig) -> "TeacherSettings":
        t, a = cfg.algorithm.distillation.teacher, cfg.actor
        assert t.path is not None, "algorithm.distillation.teacher.path is checked by the config's validation"
        model = ModelConfig(
            path=t.path,
            tokenizer_path=t.tokenizer_path,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        size = t.log_prob_micro_batch_size_per_device or a.log_prob_micro_batch_size_per_device
        return cls(
            model=ModelSettings(model=model, megatron=t.megatron, weights_path=t.path, seed=cfg.trainer.seed),
            micro=_micro(a, size or a.ppo_micro_batch_size_per_device),
            temperature=cfg.rollout.temperature,
            offload=t.offload and cfg.trainer.placement == "colocated",
        )
