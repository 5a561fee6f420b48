"""`megarl-plan [--config-name NAME] [overrides]`: the config `megarl-train` would run, sized without starting it.

Prints the device layout of each role and rollout replica, the bytes per device (parameters,
gradients, optimizer state, activations, KV cache), whether that fits `plan.device_memory_gb`,
the smallest context-parallel size at which one full-length trajectory fits, the batch algebra with
the share of padding padded vs packed (under assumed lengths), and the estimated weight-sync time.
Data, tokenizer and weight files are not needed, only the model's config.json, and nothing is
written. Exit status: 0 fits, 1 does not fit, 2 invalid config.
"""

import argparse
import sys

from hydra import compose, initialize_config_module

from megarl.config import ConfigError, register_configs, to_config
from megarl.plan.gate import validate


def main(argv: list[str] | None = None) -> None:
    """Compose like megarl-train, validate the layout (not the files), print the plan."""
    parser = argparse.ArgumentParser(prog="megarl-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="ppo", help="top-level config (as megarl-train --config-name)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=qwen3_30b_a3b trainer.nnodes=2")
    args = parser.parse_args(argv)
    from megarl.plan.report import build_plan, format_plan

    register_configs()
    try:
        with initialize_config_module("megarl.configs", version_base=None):
            config = to_config(compose(args.config_name, overrides=args.overrides))
        validate(config, check_files=False)
    except ConfigError as err:
        print(f"megarl-plan: {err}", file=sys.stderr)
        sys.exit(2)
    plan = build_plan(config)
    print(format_plan(plan))
    sys.exit(0 if plan.fits else 1)


if __name__ == "__main__":
    main()
