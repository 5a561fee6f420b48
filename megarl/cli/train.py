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
    """Attempts until one finishes: a rank or engine failure restarts the run from its latest checkpoint
    (`megarl.trainer.restarts`, at most trainer.max_restarts times); anything else stops it at once."""
    from megarl.trainer.restarts import run_with_restarts

    if run_with_restarts(cfg, _attempt) is not None:
        sys.exit(1)


def _attempt(cfg: MegarlConfig) -> BaseException | None:
    """One start of the run in a Ray cluster of its own making (or RAY_ADDRESS's): None once it finished, the error
    when it failed in a way a restart may get past; exits when it failed in any other way."""
    import ray

    from megarl.trainer.checkpoint import CheckpointError
    from megarl.trainer.metrics import RunStopped
    from megarl.trainer.prepare import prepare_run
    from megarl.trainer.restarts import RETRIABLE, retriable

    try:
        data = prepare_run(cfg)
    except DataError as err:  # what validate's bounded scan cannot see, e.g. every prompt over-long
        print(f"megarl-train: {err}", file=sys.stderr)
        sys.exit(2)
    address = os.environ.get("RAY_ADDRESS", "local")
    # The GCS keeps the events of this many tasks (Ray's default 100000: a run's ~21 calls a step grew it 4.6 MB per 100
    # steps for thousands of steps, bench/soak.py); read when this process starts the cluster.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")
    # On CPU a device is a logical slot: make sure Ray offers at least one CPU per slot.
    num_cpus = max(os.cpu_count() or 1, cfg.trainer.nnodes * cfg.trainer.devices_per_node)
    ray.init(address=address, num_cpus=num_cpus if address == "local" else None, include_dashboard=False)
    try:
        _train(cfg, data)
    except RETRIABLE as err:  # each names what failed and where
        print(f"megarl-train: {err}", file=sys.stderr)
        if not retriable(err):
            sys.exit(1)
        return err
    except (CheckpointError, RunStopped) as err:
        print(f"megarl-train: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        ray.shutdown()  # after the job stopped every role and engine
    return None


def _train(cfg: MegarlConfig, data: "PreparedData") -> None:
    from megarl.trainer.drivers import run

    run(cfg, data)


if __name__ == "__main__":
    main()
