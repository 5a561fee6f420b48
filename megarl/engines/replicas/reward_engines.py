"""Start a reward model's own engine pool (`reward_model.*.engines`): `/classify` replicas of a discriminative RM, or
`/generate` replicas of a judge, on devices of their own.

The pool is a rollout fleet of another model: `reward_engine_configs` turns a `RewardEnginesConfig` into the
`RolloutConfig` and `ModelConfig` that `launch_engines` reads, so replicas, ports, placement, keys and health checks
work as for the policy's engines. Nothing is synced into them (their weights never change), so they keep their memory
(no memory saver). Usage, a classifier on two devices::

    pool = launch_reward_engines(rm.engines, rm.path, rm.tokenizer_path, classify=True, random_init=False,
                                 devices_per_node=8, device="cuda", log_dir=run_dir / "rm_logs", keys=keys)
    ...  # POST {pool.urls[i]}/classify, each with pool.keys.api
    pool.stop()
"""

from collections.abc import Sequence
from pathlib import Path

from ray.util.placement_group import PlacementGroup

from megarl.config.model import ModelConfig
from megarl.config.reward import RewardEnginesConfig
from megarl.config.rollout import RolloutConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.replicas.launch import LaunchedReplicas, launch_engines
from megarl.engines.replicas.placement import BundleSite


def reward_engine_configs(
    engines: RewardEnginesConfig,
    model_path: str,
    tokenizer_path: str | None,
    random_init: bool,
    model_dtype: str | None = None,
) -> tuple[RolloutConfig, ModelConfig]:
    """What `launch_engines` reads for this pool. `engines.dtype=auto` means `model_dtype` (the trained model's
    `model.dtype`), or the checkpoint's own when that is None; `random_init` loads random weights (load_format
    dummy: `model_path` may hold a config only)."""
    auto = "auto" if model_dtype is None else model_dtype
    rollout = RolloutConfig(
        engine=engines.engine,
        tensor_parallel_size=engines.tensor_parallel_size,
        dtype=engines.dtype,
        mem_fraction_static=engines.mem_fraction_static,
        enable_memory_saver=False,
        server_start_timeout_s=engines.server_start_timeout_s,
        engine_kwargs=dict(engines.engine_kwargs),
    )
    return rollout, ModelConfig(path=model_path, tokenizer_path=tokenizer_path, random_init=random_init, dtype=auto)


def launch_reward_engines(
    engines: RewardEnginesConfig,
    model_path: str,
    tokenizer_path: str | None,
    classify: bool,
    random_init: bool,
    *,
    devices_per_node: int,
    device: str,
    log_dir: Path,
    keys: EngineKeys,
    placement_group: PlacementGroup | None = None,
    sites: Sequence[BundleSite] | None = None,
    num_cpus: float = 1.0,
    multi_node: bool = False,
    model_dtype: str | None = None,
) -> LaunchedReplicas:
    """Start `engines.devices` devices of replicas of `model_path` and wait until all are healthy: with `classify`
    SGLang's `/classify` (`--is-embedding`, a `*ForSequenceClassification` checkpoint), else `/generate` (a judge).
    The keyword arguments are `launch_engines`'. With `engines.urls` set nothing starts: the servers listed are
    returned as they are, reached without keys (`EngineKeys()`), and `stop` leaves them running."""
    if engines.urls:
        urls = list(engines.urls)
        return LaunchedReplicas(replicas=[], urls=urls, sites=[() for _ in urls], keys=EngineKeys())
    rollout, model = reward_engine_configs(engines, model_path, tokenizer_path, random_init, model_dtype)
    return launch_engines(
        rollout,
        model,
        num_devices=engines.devices,
        devices_per_node=devices_per_node,
        device=device,
        log_dir=log_dir,
        keys=keys,
        placement_group=placement_group,
        sites=sites,
        multi_node=multi_node,
        num_cpus=num_cpus,
        classify=classify,
    )
