"""The assembled job the drivers run: what `trainer.driver` needs, started on the current Ray cluster.

    with full_job(cfg, data) as job:        # spawns; everything stops on exit, also on errors
        sync.fit(job)

A `Job` has both sides: `Rollout` (agent workers over the engines, the driver's engine control, engine
recovery, the reward engines, validation prompts) and `Training` (the Megatron role groups, the KL
controller, checkpoints). The debug drivers get one side each: `RolloutJob` (rollout_only: no Megatron
roles) and `TrainingJob` (train_only: no engines). Nothing in a job is optional but what the config
makes so (a reference or critic, a validation set).
"""

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl import algo
from megarl.agents.manager import RolloutManager
from megarl.agents.worker import AgentSettings
from megarl.batch import Batch
from megarl.config.root import MegarlConfig
from megarl.config.sync import delivery
from megarl.data import StatefulDataLoader
from megarl.engines.client.fleet import Fleet
from megarl.engines.replicas.launch import LaunchedReplicas
from megarl.plan.facts import rollout_devices, training_devices
from megarl.sync.sequence import TRAINING_TAGS
from megarl.trainer import spawn
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.prepare import PreparedData
from megarl.trainer.recovery import EngineRecovery
from megarl.trainer.spawn import Roles
from megarl.trainer.tracking import Tracker
from megarl.workers.placement import ResourcePool

logger = logging.getLogger("megarl")


@dataclass(kw_only=True, slots=True)
class Prompts:
    """Training prompt batches, epoch after epoch; the loader keeps its position for checkpoints."""

    loader: StatefulDataLoader[Batch]
    stream: Iterator[Batch] = field(init=False)

    def __post_init__(self) -> None:
        self.stream = self._forever()

    def next(self) -> Batch:
        return next(self.stream)

    def _forever(self) -> Iterator[Batch]:
        while True:
            yield from self.loader


@dataclass(kw_only=True, slots=True)
class Rollout:
    cfg: MegarlConfig
    manager: RolloutManager
    replicas: LaunchedReplicas
    """The launched replicas: their URLs, memory sites and keys (the actor's sync reaches them through these)."""
    engines: Fleet
    """The driver's clients of the engines: pauses across an asynchronous push, releases, health."""
    recovery: EngineRecovery
    val_loader: StatefulDataLoader[Batch] | None
    """None without `data.val_files`."""


@dataclass(kw_only=True, slots=True)
class Training:
    cfg: MegarlConfig
    roles: Roles
    kl_ctrl: algo.KLController
    tokenizer: Any
    """Decodes the prompts of `trainer.dump_rollouts`."""
    dispatch: dict[str, float] = field(default_factory=dict)
    """Driver seconds spent balancing, cutting and reassembling batches since the last step's metrics."""


@dataclass(kw_only=True, slots=True)
class Basics:
    """What every driver has: the config, the metrics tracker and the run's length."""

    cfg: MegarlConfig
    tracker: Tracker
    total_steps: int
    num_devices: int
    """Devices the throughput metrics divide by: the trainer's (the rollout's without training roles)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.trainer.run_dir)


@dataclass(kw_only=True, slots=True)
class Job(Basics):
    prompts: Prompts
    rollout: Rollout
    training: Training
    checkpoints: CheckpointManager
    resumed_state: dict[str, Any] = field(default_factory=dict)
    """The trainer state of the checkpoint `resume` loaded (empty when starting fresh)."""


@dataclass(kw_only=True, slots=True)
class RolloutJob(Basics):
    prompts: Prompts
    rollout: Rollout


@dataclass(kw_only=True, slots=True)
class TrainingJob(Basics):
    training: Training


@dataclass(kw_only=True, slots=True)
class SFTJob(Basics):
    """trainer.mode=sft: the actor alone, on conversation batches; validation batches of conversations."""

    prompts: Prompts
    """Conversation batches (the name the checkpoint code shares with `Job`)."""
    val_loader: StatefulDataLoader[Batch] | None
    training: Training
    checkpoints: CheckpointManager
    resumed_state: dict[str, Any] = field(default_factory=dict)


def _basics(cfg: MegarlConfig, data: PreparedData, num_devices: int, stack: contextlib.ExitStack) -> Basics:
    """The tracker (closed by the driver's `finish`, which draws the plot from what it wrote, or when the job stops on
    an error: a restarted run opens it again)."""
    t = cfg.trainer
    tracker = Tracker(
        t.logger, Path(t.run_dir), t.project_name, t.experiment_name, dataclasses.asdict(cfg), resume=True
    )
    stack.callback(tracker.close)
    return Basics(cfg=cfg, tracker=tracker, total_steps=data.total_steps, num_devices=num_devices)


def _rollout(
    cfg: MegarlConfig, data: PreparedData, pools: dict[str, ResourcePool], stack: contextlib.ExitStack
) -> Rollout:
    """Engines on the rollout pool (the training pool when colocated), their control clients and the agent
    workers; colocated engines release their memory before any role allocates on the devices."""
    rewards = spawn.reward_engines(cfg, pools, stack)
    replicas = spawn.start_engines(cfg, pools.get("rollout", pools["train"]), stack)
    engines = spawn.engine_control(cfg, replicas, stack)
    manager = RolloutManager(
        AgentSettings.from_config(cfg, rewards), replicas.urls, replicas.keys, cfg.rollout.num_agent_workers
    )
    stack.callback(manager.close)
    colocated = cfg.trainer.placement == "colocated"
    recovery = EngineRecovery(
        supervisor=spawn.supervisor(cfg, replicas, engines),
        rollout=manager,
        release_tags=TRAINING_TAGS if colocated else [],
    )
    return Rollout(
        cfg=cfg,
        manager=manager,
        replicas=replicas,
        engines=engines,
        recovery=recovery,
        val_loader=data.val_loader,
    )


def _training(
    cfg: MegarlConfig,
    data: PreparedData,
    pools: dict[str, ResourcePool],
    rollout: Rollout | None,
    stack: contextlib.ExitStack,
) -> Training:
    replicas = rollout.replicas if rollout is not None else None
    roles = spawn.start_roles(cfg, pools["train"], replicas, data.total_steps, stack)
    kl_ctrl = algo.make_kl_controller(cfg.algorithm.kl_ctrl)
    return Training(cfg=cfg, roles=roles, kl_ctrl=kl_ctrl, tokenizer=data.tokenizer)


@contextlib.contextmanager
def full_job(cfg: MegarlConfig, data: PreparedData) -> Iterator[Job]:
    """Engines and every training role (the sync and asynchronous drivers); all of it stops on exit."""
    with contextlib.ExitStack() as stack:
        pools = spawn.pools(cfg, stack)
        rollout = _rollout(cfg, data, pools, stack)
        t = cfg.trainer
        logger.info("sync: %s", delivery(cfg.sync, t.placement, t.device, t.nnodes, training_devices(cfg)))
        if t.placement == "colocated":
            rollout.engines.wait(rollout.engines.release(TRAINING_TAGS))  # before any role allocates there
            logger.info("rollout: engines released %s for the trainer", "+".join(TRAINING_TAGS))
        training = _training(cfg, data, pools, rollout, stack)
        yield Job(
            **_fields(_basics(cfg, data, training_devices(cfg), stack)),
            prompts=Prompts(loader=data.loader),
            rollout=rollout,
            training=training,
            checkpoints=CheckpointManager(Path(t.run_dir) / "checkpoints", t.max_checkpoints_to_keep),
        )


@contextlib.contextmanager
def rollout_job(cfg: MegarlConfig, data: PreparedData) -> Iterator[RolloutJob]:
    """Engines as loaded and the agent workers; no Megatron role (the rollout_only driver)."""
    with contextlib.ExitStack() as stack:
        rollout = _rollout(cfg, data, spawn.pools(cfg, stack), stack)
        basics = _basics(cfg, data, rollout_devices(cfg), stack)
        yield RolloutJob(**_fields(basics), prompts=Prompts(loader=data.loader), rollout=rollout)


@contextlib.contextmanager
def training_job(cfg: MegarlConfig, data: PreparedData) -> Iterator[TrainingJob]:
    """The Megatron roles; no engines (the train_only driver)."""
    with contextlib.ExitStack() as stack:
        training = _training(cfg, data, spawn.pools(cfg, stack), None, stack)
        yield TrainingJob(**_fields(_basics(cfg, data, training_devices(cfg), stack)), training=training)


@contextlib.contextmanager
def sft_job(cfg: MegarlConfig, data: PreparedData) -> Iterator[SFTJob]:
    """The actor on the training pool, no engines (trainer.mode=sft); it stops on exit."""
    with contextlib.ExitStack() as stack:
        training = _training(cfg, data, spawn.pools(cfg, stack), None, stack)
        t = cfg.trainer
        yield SFTJob(
            **_fields(_basics(cfg, data, training_devices(cfg), stack)),
            prompts=Prompts(loader=data.loader),
            val_loader=data.val_loader,
            training=training,
            checkpoints=CheckpointManager(Path(t.run_dir) / "checkpoints", t.max_checkpoints_to_keep),
        )


def _fields(basics: Basics) -> dict[str, Any]:
    return {f.name: getattr(basics, f.name) for f in dataclasses.fields(Basics)}
