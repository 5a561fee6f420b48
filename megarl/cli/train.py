"""`megarl-train [overrides]`: compose the config with Hydra, validate it, then train.

Hydra's own flags work: `megarl-train --cfg job` prints the composed config, `--config-name
demo_cpu` picks another top-level config, `--help` lists the groups. Nothing is spawned before
the config validated and the data loaded; `trainer.mode` picks train | rollout_only | train_only.
"""

import os
import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from megarl.cli import typed_config
from megarl.config import MegarlConfig, register_configs
from megarl.data.checks import DataError

if TYPE_CHECKING:
    from megarl.trainer.prepare import PreparedData

register_configs()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def main(cfg: DictConfig) -> None:
    """Turn the DictConfig into typed dataclasses once, validate, then run."""
    run(typed_config(cfg, "megarl-train"))


def run(cfg: MegarlConfig) -> None:
    import ray

    from megarl.engines.replicas.supervisor import EngineLost
    from megarl.trainer.checkpoint import CheckpointError
    from megarl.trainer.metrics import RunStopped
    from megarl.trainer.prepare import prepare_run
    from megarl.workers.group import RankFailure

    try:
        data = prepare_run(cfg)
    except DataError as err:  # what validate's bounded scan cannot see, e.g. every prompt over-long
        print(f"megarl-train: {err}", file=sys.stderr)
        sys.exit(2)
    address = os.environ.get("RAY_ADDRESS", "local")
    # On CPU a device is a logical slot: make sure Ray offers at least one CPU per slot.
    num_cpus = max(os.cpu_count() or 1, cfg.trainer.nnodes * cfg.trainer.devices_per_node)
    ray.init(address=address, num_cpus=num_cpus if address == "local" else None, include_dashboard=False)
    try:
        _train(cfg, data)
    except (RankFailure, EngineLost, CheckpointError, RunStopped) as err:  # each names what failed and where
        print(f"megarl-train: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        ray.shutdown()  # after running_job stopped every role and engine


def _train(cfg: MegarlConfig, data: "PreparedData") -> None:
    from megarl.trainer.async_drivers import fully_async, one_step_off
    from megarl.trainer.build import running_job
    from megarl.trainer.modes import rollout_only, train_only

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


if __name__ == "__main__":
    main()
