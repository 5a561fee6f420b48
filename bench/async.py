"""Synchronous vs asynchronous training at equal samples, with long-tail environment latencies.

The CPU demo task (single-digit addition, GRPO) with `async_env.SlowEnvAgentLoop`: after each
generation the trajectory waits on a simulated environment whose latency is lognormal (median 0.25 s,
a tail to 6 s, seeded per sample), as tool-using agentic RL does. Three runs of the same number of
steps × prompts × samples, one after another on this machine:

- sync: `trainer.driver=sync` (`drivers/sync.py: fit`), colocated (the demo's layout: Megatron TP=2 and two
  engines on the 2 slots);
- one_step_off and fully_async: `trainer.placement=separate`, 1 trainer slot + 1 engine slot.

It prints each run's wall seconds over its training steps (start-up excluded), the ratio to sync, and
the mean reward of the last half of the steps with its standard error over steps.

    .venv/bin/python bench/async.py [--steps 12] [overrides ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "rollout.default_agent=async_env:SlowEnvAgentLoop",
    "data.train_batch_size=8",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_device=32",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
]
SEPARATE = [
    "trainer.placement=separate",
    "trainer.rollout_devices=1",
    "actor.megatron.tensor_model_parallel_size=1",
]
MODES = {
    "sync": [],
    "one_step_off": [*SEPARATE, "trainer.driver=one_step_off"],
    "fully_async": [*SEPARATE, "trainer.driver=fully_async", "async_training.max_staleness=1"],
}


def run(mode: str, root: Path, steps: int, extra: list[str]) -> list[dict[str, float]]:
    run_dir = root / mode
    command = [
        str(Path(sys.executable).with_name("megarl-train")),
        "--config-name",
        "demo_cpu",
        "model=tiny_dense",
        "trainer.val_before_train=false",
        f"trainer.run_dir={run_dir}",
        f"data.train_files=[{root}/data/train.parquet]",
        f"data.val_files=[{root}/data/test.parquet]",
        f"trainer.total_training_steps={steps}",
        *COMMON,
        *MODES[mode],
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "bench"), "WANDB_MODE": "offline"}
    subprocess.run(command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict[str, float]]) -> tuple[float, float, float]:
    """(seconds over the training steps, mean reward of the last half, its standard error over steps)."""
    seconds = sum(r["timing/step"] for r in records if "timing/step" in r)
    rewards = [r["reward/score/mean"] for r in records if "reward/score/mean" in r]
    tail = rewards[len(rewards) // 2 :]
    error = statistics.stdev(tail) / len(tail) ** 0.5 if len(tail) > 1 else float("nan")
    return seconds, statistics.mean(tail), error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="extra megarl-train overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-async") as tmp:
        root = Path(tmp)
        exe = Path(sys.executable).with_name("megarl-preprocess")
        for split in ("train", "test"):
            out = root / "data" / f"{split}.parquet"
            subprocess.run([str(exe), "arith", "--output", str(out), "--num-rows", "512", "--split", split], check=True)
        results = {mode: summary(run(mode, root, args.steps, args.overrides)) for mode in MODES}
    samples = args.steps * 8 * 4
    print(f"{samples} samples per run ({args.steps} steps × 8 prompts × 4 samples)")
    print(f"{'mode':<14}{'seconds':>10}{'vs sync':>10}{'reward (last half)':>22}")
    sync_seconds = results["sync"][0]
    for mode, (seconds, reward, error) in results.items():
        print(f"{mode:<14}{seconds:>10.1f}{sync_seconds / seconds:>9.2f}×{reward:>14.3f} ± {error:.3f}")


if __name__ == "__main__":
    main()
