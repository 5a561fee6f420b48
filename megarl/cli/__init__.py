"""Console entry points: megarl-train, megarl-serve, megarl-preprocess, megarl-convert."""

import sys

from omegaconf import DictConfig

from megarl.config import ConfigError, MegarlConfig, to_config
from megarl.plan.gate import validate


def typed_config(cfg: DictConfig, prog: str) -> MegarlConfig:
    """Hydra's DictConfig as the validated dataclass tree; on a ConfigError print it and exit 2."""
    try:
        config = to_config(cfg)
        validate(config)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)
    return config
