"""`megarl-train [overrides]`: compose the config with Hydra, validate it, prepare the run.

Hydra's own flags work: `megarl-train --cfg job` prints the composed config, `--config-name
demo_cpu` picks another top-level config, `--help` lists the groups.
"""

import sys

import hydra
from omegaconf import DictConfig

from megarl.config import ConfigError, register_configs, to_config, validate

register_configs()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def main(cfg: DictConfig) -> None:
    """Turn the DictConfig into typed dataclasses once, validate, then run."""
    try:
        config = to_config(cfg)
        validate(config)
    except ConfigError as err:
        print(f"megarl-train: {err}", file=sys.stderr)
        sys.exit(2)
    from megarl.cli.prepare import prepare_run

    prepare_run(config)
