"""`megarl-train [overrides]`: compose the config with Hydra, validate it, then train.

Hydra's own flags work: `megarl-train --cfg job` prints the composed config, `--config-name
demo_cpu` picks another top-level config, `--help` lists the groups. Nothing is spawned before
the config validated and the data loaded; `trainer.mode` picks train | rollout_only | train_only.
"""

import os

import hydra
from omegaconf import DictConfig

from megarl.cli import typed_config
from megarl.config import MegarlConfig, register_configs

register_configs()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def main(cfg: DictConfig) -> None:
    """Turn the DictConfig into typed dataclasses once, validate, then run."""
    run(typed_config(cfg, "megarl-train"))


def run(cfg: MegarlConfig) -> None:
    import ray

    from megarl.cli.prepare import prepare_run
    from megarl.trainer.async_drivers import fully_async, one_step_off
    from megarl.trainer.build import running_job
    from megarl.trainer.modes import rollout_only, train_only

    data = prepare_run(cfg)
    address = os.environ.get("RAY_ADDRESS", "local")
    # On CPU a device is a logical slot: make sure Ray offers at least one CPU per slot.
    num_cpus = max(os.cpu_count() or 1, cfg.trainer.nnodes * cfg.trainer.devices_per_node)
    ray.init(address=address, num_cpus=num_cpus if address == "local" else None, include_dashboard=False)
    try:
        with running_job(cfg, data) as trainer:
            if cfg.trainer.mode == "rollout_only":
                rollout_only(trainer)
            elif cfg.trainer.mode == "train_only":
                train_only(trainer)
            elif cfg.async_training.mode == "one_step_off":
                one_step_off(trainer)
            elif cfg.async_training.mode == "fully_async":
                fully_async(trainer)
            else:
                trainer.fit()
    finally:
        ray.shutdown()
