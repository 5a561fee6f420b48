"""`megarl-train [overrides]`: compose the config with Hydra, validate it, then train.

Hydra's own flags work: `megarl-train --cfg job` prints the composed config, `--config-name
demo_cpu` picks another top-level config, `--help` lists the groups. Nothing is spawned before
the config validated and the data loaded; `trainer.driver` picks what runs the steps.
"""

import os
import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from megarl.cli import refuse_moved_keys, typed_config
from megarl.config import MegarlConfig, register_configs
from megarl.data.checks import DataError

if TYPE_CHECKING:
    from megarl.trainer.prepare import PreparedData

register_configs()


def main() -> None:
    """`megarl-train [overrides]`: moved keys are refused with their new names, then Hydra composes the config."""
    refuse_moved_keys(sys.argv[1:], "megarl-train")
    _main()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def _main(cfg: DictConfig) -> None:
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
        ray.shutdown()  # after the job stopped every role and engine


def _train(cfg: MegarlConfig, data: "PreparedData") -> None:
    from megarl.trainer.drivers import run

    run(cfg, data)


if __name__ == "__main__":
    main()
