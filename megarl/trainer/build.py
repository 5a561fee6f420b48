"""Config → running job: Ray pools, rollout engines, role worker groups, the `Trainer` around them.

    with running_job(cfg, data) as trainer:    # spawns; everything stops on exit, also on errors
        trainer.fit()

What is started depends on `trainer.mode`: train (all), rollout_only (engines, no Megatron roles),
train_only (Megatron roles, no engines).
"""

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from megarl.config.root import MegarlConfig
from megarl.config.sync import delivery, trainer_env
from megarl.engines.replicas.placement import memory_site
from megarl.plan.facts import critic_enabled, reference_needed, rollout_devices, training_devices
from megarl.sync.sequence import TRAINING_TAGS
from megarl.trainer.driver import Roles, Trainer
from megarl.trainer.engine_recovery import EngineRecovery
from megarl.trainer.prepare import PreparedData
from megarl.workers.actor import ActorWorker
from megarl.workers.base import RankWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.placement import ROLE_SHARE, ResourcePool, make_pools
from megarl.workers.reference import ReferenceWorker

if TYPE_CHECKING:
    from megarl.agents.manager import RolloutManager
    from megarl.engines.client.fleet import Fleet
    from megarl.engines.replicas.launch import LaunchedReplicas

logger = logging.getLogger("megarl")


def _engines(cfg: MegarlConfig, pool: ResourcePool, stack: contextlib.ExitStack) -> "LaunchedReplicas":
    from megarl.engines.client.auth import EngineKeys
    from megarl.engines.replicas.launch import launch_engines

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


def _control(cfg: MegarlConfig, fleet: "LaunchedReplicas", stack: contextlib.ExitStack) -> "Fleet":
    """The driver's clients of the engines, each control call within `sync.timeout_s`."""
    from megarl.engines.client.client import ClientTimeouts
    from megarl.engines.client.fleet import Fleet

    engines = Fleet.connect(fleet.urls, fleet.keys, ClientTimeouts(control_s=cfg.sync.timeout_s))
    stack.callback(engines.shutdown)
    return engines


def _recovery(
    cfg: MegarlConfig, fleet: "LaunchedReplicas", engines: "Fleet", rollout: "RolloutManager"
) -> EngineRecovery:
    """Restarts within rollout.max_engine_restarts(_per_replica); colocated engines sleep again after one."""
    from megarl.engines.replicas.supervisor import EngineSupervisor, RestartBounds

    r = cfg.rollout
    bounds = RestartBounds(
        per_replica=r.max_engine_restarts_per_replica,
        per_run=r.max_engine_restarts,
        start_timeout_s=r.server_start_timeout_s,
        health_timeout_s=min(r.request_timeout_s, 60.0),
    )
    tags = TRAINING_TAGS if cfg.trainer.placement == "colocated" else []
    supervisor = EngineSupervisor(replicas=fleet.replicas, engines=engines, bounds=bounds)
    return EngineRecovery(supervisor=supervisor, rollout=rollout, release_tags=tags)


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


def _roles(
    cfg: MegarlConfig, pool: ResourcePool, fleet: "LaunchedReplicas | None", steps: int, stack: contextlib.ExitStack
) -> Roles:
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
        lambda g: g.broadcast(ActorWorker.setup, cfg, steps, urls, engine_sites, rank_sites, keys),
        timeout,
        env,
    )
    ref = critic = None
    if reference_needed(cfg):
        ref = _group(
            ReferenceWorker, pool, "ref", stack, lambda g: g.broadcast(ReferenceWorker.setup, cfg), timeout, env
        )
    if critic_enabled(cfg):
        critic = _group(
            CriticWorker, pool, "critic", stack, lambda g: g.broadcast(CriticWorker.setup, cfg, steps), timeout, env
        )
    logger.info(
        "roles: actor%s%s on %d device(s)",
        " + ref" * (ref is not None),
        " + critic" * (critic is not None),
        len(actor.workers),
    )
    return Roles(actor=actor, ref=ref, critic=critic)


@contextlib.contextmanager
def running_job(cfg: MegarlConfig, data: PreparedData) -> Iterator[Trainer]:
    """Start what `trainer.mode` needs on the current Ray cluster; stop all of it on exit."""
    from megarl.agents.manager import RolloutManager
    from megarl.agents.worker import AgentSettings

    mode = cfg.trainer.mode
    with contextlib.ExitStack() as stack:
        pools = make_pools(cfg)
        for pool in pools.values():
            stack.callback(pool.remove)
        fleet = engines = rollout = None
        if mode != "train_only":
            fleet = _engines(cfg, pools.get("rollout", pools["train"]), stack)
            engines = _control(cfg, fleet, stack)
            # the actor's ColocatedSequence puts the engines to sleep and wakes them every step
            rollout = RolloutManager(
                AgentSettings.from_config(cfg), fleet.urls, fleet.keys, cfg.rollout.num_agent_workers
            )
            stack.callback(rollout.close)
            if mode == "train":
                t = cfg.trainer
                logger.info("sync: %s", delivery(cfg.sync, t.placement, t.device, t.nnodes, training_devices(cfg)))
            if mode == "train" and cfg.trainer.placement == "colocated":
                engines.wait(engines.release(TRAINING_TAGS))  # before any role allocates on the devices
                logger.info("rollout: engines released %s for the trainer", "+".join(TRAINING_TAGS))
        roles = None
        if mode != "rollout_only":
            roles = _roles(cfg, pools["train"], fleet, data.total_steps, stack)
        trainer = Trainer(
            cfg,
            roles=roles,
            rollout=rollout,
            engines=engines,
            tokenizer=data.tokenizer,
            loader=data.loader,
            val_loader=data.val_loader,
            total_steps=data.total_steps,
            num_devices=training_devices(cfg) if mode != "rollout_only" else rollout_devices(cfg),
        )
        if fleet is not None and engines is not None and rollout is not None and mode == "train":
            trainer.recovery = _recovery(cfg, fleet, engines, rollout)
        yield trainer
