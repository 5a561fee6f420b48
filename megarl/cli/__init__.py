"""Console entry points: megarl-train, megarl-serve, megarl-preprocess, megarl-convert."""

import sys

from omegaconf import DictConfig

from megarl.config import ConfigError, MegarlConfig, to_config
from megarl.plan.gate import validate

MOVED_KEYS = {
    "trainer.mode": "trainer.driver (train is now sync; rollout_only and train_only keep their names)",
    "async_training.mode": "trainer.driver (off is now sync; one_step_off and fully_async keep their names)",
}
"""Keys that moved, and where to: one key, trainer.driver, chooses what runs the steps."""
REUSED_KEYS = {"trainer.mode": ("rl", "sft")}
"""Moved keys that came back with other values (`trainer.mode`: RL or SFT); only their old values are refused."""


def moved_key_problems(overrides: list[str]) -> list[str]:
    """One sentence per command-line override that sets a moved key (`MOVED_KEYS`) to an old value, naming its new
    key."""
    pairs = [override.split("=", 1) for override in overrides if "=" in override]
    return [
        f"{key} was replaced by {MOVED_KEYS[key]}"
        for key, value in ((key.lstrip("+~"), value) for key, value in pairs)
        if key in MOVED_KEYS and value not in REUSED_KEYS.get(key, ())
    ]


def refuse_moved_keys(overrides: list[str], prog: str) -> None:
    """Before Hydra composes (its own error names the key but not its new name): print and exit 2."""
    problems = moved_key_problems(overrides)
    if problems:
        print(f"{prog}: " + "; ".join(problems), file=sys.stderr)
        sys.exit(2)


def typed_config(cfg: DictConfig, prog: str) -> MegarlConfig:
    """Hydra's DictConfig as the validated dataclass tree; on a ConfigError print it and exit 2."""
    try:
        config = to_config(cfg)
        validate(config)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)
    return config
