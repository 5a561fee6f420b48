"""`megarl-train [overrides]`: compose the config with Hydra, validate it, prepare the run.

Hydra's own flags work: `megarl-train --cfg job` prints the composed config, `--config-name
demo_cpu` picks another top-level config, `--help` lists the groups.
"""

import hydra
from omegaconf import DictConfig

from megarl.cli import typed_config
from megarl.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="pkg://megarl.configs", config_name="ppo")
def main(cfg: DictConfig) -> None:
    """Turn the DictConfig into typed dataclasses once, validate, then run."""
    config = typed_config(cfg, "megarl-train")
    from megarl.cli.prepare import prepare_run

    prepare_run(config)
