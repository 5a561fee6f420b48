"""What a validated config implies for the run, computed once on the driver side.

The devices of each pool (`training_devices`, `rollout_devices`, `reward_pool_devices`), the batch-size algebra of
a training role (`batch_sizes`), and which optional roles run (`critic_enabled`, `reference_needed`). The gate
(`megarl.plan.gate.validate`), the plan, the trainer's builder and the workers read them from here.
"""

from dataclasses import dataclass

from megarl import algo
from megarl.config import trainer
from megarl.config.root import MegarlConfig


@dataclass(frozen=True, slots=True)
class BatchSizes:
    """The batch-size algebra of one training role, in trajectories unless named otherwise.

    A step has `data.train_batch_size` prompts × `rollout.n` samples. A mini-batch (one optimizer
    step) has `ppo_mini_batch_size` prompts × n samples, split evenly over `dp` data-parallel ranks,
    each running `micro_batches` forward/backward passes of `ppo_micro_batch_size_per_device`
    (or token-budget micro-batches when use_dynamic_bsz, then `micro_batches` is None).
    """

    trajectories_per_step: int
    trajectories_per_mini_batch: int
    mini_batches_per_step: int
    dp: int
    trajectories_per_device: int | None
    micro_batches: int | None


def reward_pool_devices(cfg: MegarlConfig) -> dict[str, int]:
    """The scoring models' own pools, name → devices: `judge` (the generative RM's engines), `classifier` (the
    discriminative RM's `/classify` engines, backend=server) and `teacher` (the distillation teacher's engines,
    backend=engine), each unless its `engines.urls` names running servers. They come out of nnodes ×
    devices_per_node before the trainer's and the rollout's devices."""
    rm, judge = cfg.reward_model.discriminative, cfg.reward_model.generative
    teacher = cfg.algorithm.distillation.teacher
    pools = {}
    if cfg.algorithm.distillation.enable and teacher.backend == "engine" and not teacher.engines.urls:
        pools["teacher"] = teacher.engines.devices
    if judge.enable and not judge.engines.urls:
        pools["judge"] = judge.engines.devices
    if rm.enable and rm.backend == "server" and not rm.engines.urls:
        pools["classifier"] = rm.engines.devices
    return pools


def training_devices(cfg: MegarlConfig) -> int:
    """Devices the Megatron roles run on: all but the reward pools' when colocated, less `trainer.rollout_devices`
    too when separate."""
    return trainer.pool_sizes(cfg.trainer, sum(reward_pool_devices(cfg).values()))[0]


def rollout_devices(cfg: MegarlConfig) -> int:
    """Devices the rollout replicas run on: the training devices when colocated, else `trainer.rollout_devices`."""
    return trainer.pool_sizes(cfg.trainer, sum(reward_pool_devices(cfg).values()))[1]


def batch_sizes(cfg: MegarlConfig, role: str) -> BatchSizes:
    """The batch algebra of `role` ("actor" or "critic"), assuming the config validated."""
    role_cfg = cfg.actor if role == "actor" else cfg.critic
    mp = role_cfg.megatron
    model_parallel = mp.tensor_model_parallel_size * mp.pipeline_model_parallel_size * mp.context_parallel_size
    dp = training_devices(cfg) // model_parallel
    n = samples_per_prompt(cfg)
    mini = role_cfg.ppo_mini_batch_size * n
    per_device = None if role_cfg.use_dynamic_bsz else mini // dp
    return BatchSizes(
        trajectories_per_step=cfg.data.train_batch_size * n,
        trajectories_per_mini_batch=mini,
        mini_batches_per_step=cfg.data.train_batch_size // role_cfg.ppo_mini_batch_size,
        dp=dp,
        trajectories_per_device=per_device,
        micro_batches=None if per_device is None else per_device // role_cfg.ppo_micro_batch_size_per_device,
    )


def samples_per_prompt(cfg: MegarlConfig) -> int:
    """`rollout.n`; one in SFT (a conversation is one row)."""
    return 1 if cfg.trainer.mode == "sft" else cfg.rollout.n


def critic_enabled(cfg: MegarlConfig) -> bool:
    """The critic trains when asked to, or by default when the estimator needs values (never in SFT)."""
    if cfg.trainer.mode == "sft":
        return False
    if cfg.critic.enable is None:
        return estimator_traits(cfg.algorithm.adv_estimator).uses_critic
    return cfg.critic.enable


def reference_needed(cfg: MegarlConfig) -> bool:
    """The reference runs only when a KL term reads it (never in SFT)."""
    return cfg.trainer.mode == "rl" and (cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def teacher_role_needed(cfg: MegarlConfig) -> bool:
    """On-policy distillation with the teacher as a Megatron role (`algorithm.distillation.teacher.backend`)."""
    d = cfg.algorithm.distillation
    return cfg.trainer.mode == "rl" and d.enable and d.teacher.backend == "megatron"


def estimator_traits(name: str) -> algo.EstimatorTraits:
    """Traits of a known estimator; an unknown name has none (the gate reports it)."""
    try:
        return algo.estimator_traits(name)
    except ValueError:
        return algo.EstimatorTraits()
