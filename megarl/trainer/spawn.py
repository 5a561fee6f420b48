"""Starting the job's processes on the current Ray cluster (`megarl.trainer.job` assembles them): the resource
pools, the engine replicas and the driver's control of them, the engine supervisor, the Megatron role groups.
Each registers its stop on the caller's `ExitStack`.
"""

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from megarl.config.root import MegarlConfig
from megarl.config.sync import trainer_env
from megarl.engines.replicas.placement import memory_site
from megarl.plan.facts import critic_enabled, reference_needed, rollout_devices, teacher_role_needed
from megarl.scoring.pipeline import RewardSettings
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.placement import ROLE_SHARE, ResourcePool, make_pools
from megarl.workers.reference import ReferenceHost, ReferenceWorker
from megarl.workers.reward_model import RewardModelWorker
from megarl.workers.settings import (
    ActorSettings,
    CriticSettings,
    ReferenceSettings,
    RewardModelSettings,
    TeacherSettings,
)
from megarl.workers.teacher import TeacherWorker

if TYPE_CHECKING:
    from megarl.engines.client.fleet import Fleet
    from megarl.engines.replicas.launch import LaunchedReplicas
    from megarl.engines.replicas.supervisor import EngineSupervisor

logger = logging.getLogger("megarl")


def start_engines(cfg: MegarlConfig, pool: ResourcePool, stack: contextlib.ExitStack) -> "LaunchedReplicas":
    """The replicas of `rollout.*` on `pool`, one key pair per run; stopped on exit."""
    from megarl.engines.client.auth import EngineKeys
    from megarl.engines.replicas.launch import launch_engines, lora_serving

    t = cfg.trainer
    fleet = launch_engines(
        cfg.rollout,
        cfg.model,
        num_devices=rollout_devices(cfg),
        devices_per_node=t.devices_per_node,
        device=t.device,
        log_dir=Path(t.run_dir) / "engine_logs",
        keys=EngineKeys.generate(),  # one pair per run, whatever the servers bind to (megarl.engines.client.auth)
        placement_group=pool.group,
        sites=pool.sites,
        multi_node=t.nnodes > 1,
        num_cpus=ROLE_SHARE,
        lora=lora_serving(cfg.actor.lora),  # sync=adapter: every replica serves the actor's adapters
    )
    stack.callback(fleet.stop)
    logger.info(
        "rollout: %d %s replica(s) on the %s pool (%d device(s)) at %s",
        len(fleet.urls),
        cfg.rollout.engine,
        pool.name,
        pool.num_devices,
        ", ".join(fleet.urls),
    )
    logger.info("rollout: the engines' bearer keys are in %s", fleet.keys.write(Path(t.run_dir) / "engine_keys.json"))
    return fleet


def reward_engines(cfg: MegarlConfig, pools: dict[str, ResourcePool], stack: contextlib.ExitStack) -> RewardSettings:
    """The judge's, the RM's `/classify` and the distillation teacher's replicas on their own pools (or the servers
    their `engines.urls` name), stopped on exit, as the agent workers' reward settings."""
    from megarl.engines.client.auth import EngineKeys
    from megarl.engines.replicas.reward_engines import launch_reward_engines

    models, t = cfg.reward_model, cfg.trainer
    distill = cfg.algorithm.distillation
    teacher = distill.teacher
    settings = RewardSettings(reward=cfg.reward, models=models)
    wanted = (
        ("judge", models.generative, models.generative.enable, False),
        (
            "classifier",
            models.discriminative,
            models.discriminative.enable and models.discriminative.backend == "server",
            True,
        ),
        ("teacher", teacher, distill.enable and teacher.backend == "engine", False),
    )
    for name, rm, enabled, classify in wanted:
        if not enabled:
            continue
        assert rm.path is not None, "the gate checks reward_model.*.path"
        pool = pools.get(name)
        launched = launch_reward_engines(
            rm.engines,
            rm.path,
            rm.tokenizer_path,
            classify,
            random_init=getattr(rm, "random_init", False),
            devices_per_node=t.devices_per_node,
            device=t.device,
            log_dir=Path(t.run_dir) / "engine_logs" / name,
            keys=EngineKeys.generate(),
            placement_group=pool.group if pool else None,
            sites=pool.sites if pool else None,
            multi_node=t.nnodes > 1,
        )
        stack.callback(launched.stop)
        logger.info("reward: %s on %d replica(s) at %s", name, len(launched.urls), ", ".join(launched.urls))
        setattr(settings, f"{name}_urls", launched.urls)
        setattr(settings, f"{name}_keys", launched.keys)
    return settings


def engine_control(cfg: MegarlConfig, fleet: "LaunchedReplicas", stack: contextlib.ExitStack) -> "Fleet":
    """The driver's clients of the engines, each control call within `sync.timeout_s`."""
    from megarl.engines.client.client import ClientTimeouts
    from megarl.engines.client.fleet import Fleet

    engines = Fleet.connect(fleet.urls, fleet.keys, ClientTimeouts(control_s=cfg.sync.timeout_s))
    stack.callback(engines.shutdown)
    return engines


def supervisor(cfg: MegarlConfig, fleet: "LaunchedReplicas", engines: "Fleet") -> "EngineSupervisor":
    """Restarts within rollout.max_engine_restarts(_per_replica)."""
    from megarl.engines.replicas.supervisor import EngineSupervisor, RestartBounds

    r = cfg.rollout
    bounds = RestartBounds(
        per_replica=r.max_engine_restarts_per_replica,
        per_run=r.max_engine_restarts,
        start_timeout_s=r.server_start_timeout_s,
        health_timeout_s=min(r.request_timeout_s, 60.0),
    )
    return EngineSupervisor(replicas=fleet.replicas, engines=engines, bounds=bounds)


def pools(cfg: MegarlConfig, stack: contextlib.ExitStack) -> dict[str, ResourcePool]:
    """The Ray placement groups of `trainer.placement`: "train", and "rollout" when separate; removed on exit."""
    made = make_pools(cfg)
    for pool in made.values():
        stack.callback(pool.remove)
    return made


W = TypeVar("W", bound=RankWorker)


def _group(
    cls: type[W],
    pool: ResourcePool,
    name: str,
    stack: contextlib.ExitStack,
    setup: Callable[[WorkerGroup[W]], object],
    failure_timeout_s: float,
    env: dict[str, str],
) -> WorkerGroup[W]:
    group = WorkerGroup(cls, pool, name, failure_timeout_s=failure_timeout_s, env=env)
    stack.callback(group.shutdown)
    setup(group)
    return group


@dataclass(kw_only=True, slots=True)
class Roles:
    actor: WorkerGroup[ActorWorker]
    ref: WorkerGroup[ReferenceHost] | None = None
    """None unless the algorithm reads reference log-probs (`plan.facts.reference_needed`); the actor's group
    when the reference shares its layout (`ActorWorker.host_reference`)."""
    critic: WorkerGroup[CriticWorker] | None = None
    """None unless the estimator uses values (`plan.facts.critic_enabled`)."""
    rm: WorkerGroup[RewardModelWorker] | None = None
    """The discriminative reward model when it runs on Megatron (`reward_model.discriminative.backend=megatron`)."""
    teacher: WorkerGroup[TeacherWorker] | None = None
    """The distillation teacher when it runs on Megatron (`algorithm.distillation.teacher.backend=megatron`)."""

    def offloading(self) -> dict[str, WorkerGroup[RankWorker]]:
        """Role name → the group of the reference, the critic, the RM and the teacher (each leaves the device for the
        rollout when it offloads)."""
        groups = (("ref", self.ref), ("critic", self.critic), ("rm", self.rm), ("teacher", self.teacher))
        return {name: group for name, group in groups if group is not None}

    def trainable(self) -> list[WorkerGroup[RankWorker]]:
        """The groups a checkpoint saves: the actor, and the critic."""
        return [group for group in (self.actor, self.critic) if group is not None]

    def all(self) -> list[WorkerGroup[RankWorker]]:
        """Every group once (a hosted reference has none of its own)."""
        groups = [group for group in (self.actor, self.ref, self.critic, self.rm, self.teacher) if group is not None]
        return list({id(group): group for group in groups}.values())


def start_roles(
    cfg: MegarlConfig, pool: ResourcePool, fleet: "LaunchedReplicas | None", steps: int, stack: contextlib.ExitStack
) -> Roles:
    """The actor, and the reference and critic the algorithm needs, set up on `pool`; `fleet`: the engines the
    actor syncs into (None: train_only)."""
    urls, engine_sites = (fleet.urls, fleet.sites) if fleet is not None else ([], [])
    keys = fleet.keys if fleet is not None else None
    rank_sites = tuple(memory_site(site, cfg.trainer.device) for site in pool.sites)
    timeout = cfg.trainer.failure_timeout_s
    env = trainer_env(cfg.sync, cfg.trainer.placement, cfg.trainer.device)
    actor = _group(
        ActorWorker,
        pool,
        "actor",
        stack,
        lambda g: g.broadcast(
            ActorWorker.setup, ActorSettings.from_config(cfg, steps), urls, engine_sites, rank_sites, keys
        ),
        timeout,
        env,
    )
    ref: WorkerGroup[ReferenceHost] | None = None
    critic = None
    if reference_needed(cfg) and cfg.ref.megatron is None:
        actor.broadcast(ActorWorker.host_reference, ReferenceSettings.from_config(cfg))
        ref = actor
    elif reference_needed(cfg):
        ref = _group(
            ReferenceWorker,
            pool,
            "ref",
            stack,
            lambda g: g.broadcast(ReferenceWorker.setup, ReferenceSettings.from_config(cfg)),
            timeout,
            env,
        )
    if critic_enabled(cfg):
        critic = _group(
            CriticWorker,
            pool,
            "critic",
            stack,
            lambda g: g.broadcast(CriticWorker.setup, CriticSettings.from_config(cfg, steps)),
            timeout,
            env,
        )
    rm = None
    if cfg.reward_model.discriminative.enable and cfg.reward_model.discriminative.backend == "megatron":
        rm = _group(
            RewardModelWorker,
            pool,
            "rm",
            stack,
            lambda g: g.broadcast(RewardModelWorker.setup, RewardModelSettings.from_config(cfg)),
            timeout,
            env,
        )
    teacher = None
    if teacher_role_needed(cfg):
        teacher = _group(
            TeacherWorker,
            pool,
            "teacher",
            stack,
            lambda g: g.broadcast(TeacherWorker.setup, TeacherSettings.from_config(cfg)),
            timeout,
            env,
        )
    where = (
        " (the actor with its LoRA adapters off)"
        if cfg.actor.lora.enabled
        else " (the reference in the actor's processes)"
    )
    logger.info(
        "roles: actor%s%s%s%s on %d device(s)%s",
        " + ref" * (ref is not None),
        " + critic" * (critic is not None),
        " + rm" * (rm is not None),
        " + teacher" * (teacher is not None),
        len(actor.workers),
        where * (ref is actor),
    )
    return Roles(actor=actor, ref=ref, critic=critic, rm=rm, teacher=teacher)
