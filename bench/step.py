"""Where a training step's time goes: the CPU demo (its data and format warm-up, TP=2, GRPO, colocated)
run for a few steps, then each phase's mean over the steps after the first (its start-up costs are not typical),
the hand-over broken down, and the shares of hand-over and of driver overhead in the step.

- hand-over = `timing/engine_sleep` (to_training: engines release, trainer memory back) + `timing/sync`
  (to_rollout: trainer memory out, engines wake, weights pushed): everything colocation and resharding
  cost. Its pieces are `ColocatedSequence`'s `sync/<step>_s` timings; "rest" is what the phase spent
  outside them: the engines' restart checks, Ray calls to the roles, reference/critic offload.
- driver overhead = the driver's own work: `timing/dispatch` (balancing DP shards, cutting and
  shipping batches to the workers, reassembling results: inside the worker phases' times), `timing/adv`
  (advantages on the driver), and whatever of the step no phase covers (metrics, logging).

    .venv/bin/python bench/step.py [--steps 6] [overrides ...]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = (
    "gen",
    "engine_sleep",
    "old_log_prob",
    "ref",
    "values",
    "reward",
    "adv",
    "update_critic",
    "update_actor",
    "save_checkpoint",
    "sync",
    "testing",
)

HANDOVER = {
    "engine_sleep": (
        ("engine release (kv_cache, weights)", ("sync/engine_sleep_s",)),
        ("trainer reload", ("sync/trainer_reload_s",)),
    ),
    "sync": (
        ("trainer offload", ("sync/trainer_free_state_s", "sync/trainer_free_params_s")),
        ("engine wake weights", ("sync/engine_wake_weights_s",)),
        ("weight push", ("sync/weights_s",)),
        ("engine wake kv_cache", ("sync/engine_wake_kv_s",)),
    ),
}
"""Each hand-over phase's pieces: (label, the metrics it sums)."""
HANDOVER_GOAL = 0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="extra megarl-train overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-step") as tmp:
        data = Path(tmp) / "data"
        exe = Path(sys.executable).with_name("megarl-preprocess")
        for split in ("train", "test"):
            out = data / f"{split}.parquet"
            subprocess.run(
                [str(exe), "largest", "--output", str(out), "--num-rows", "256", "--split", split], check=True
            )
        subprocess.run([str(exe), "largest-sft", "--output", f"{data}/sft.parquet", "--num-rows", "3200"], check=True)
        warmup = [
            "trainer.mode=sft",
            "+experiment=sft_largest",
            f"data.train_files=[{data}/sft.parquet]",
            f"trainer.run_dir={tmp}/sft",
            f"sft.hf_output={tmp}/warmup",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        train = Path(sys.executable).with_name("megarl-train")
        subprocess.run([str(train), *warmup], check=True, cwd=REPO, env=env)  # the demo's format warm-up (SFT)
        overrides = [
            f"trainer.run_dir={tmp}/run",
            f"model.path={tmp}/warmup",
            f"data.train_files=[{data}/train.parquet]",
            f"data.val_files=[{data}/test.parquet]",
            f"trainer.total_training_steps={args.steps}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=0",  # saves only at the last step, which the report leaves out
            "trainer.progress_bar=false",
            "trainer.logger=[console]",
            *args.overrides,
        ]
        subprocess.run([str(train), "--config-name", "demo_cpu", *overrides], check=True, cwd=REPO, env=env)
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    report(records[1:-1] if len(records) > 2 else records)  # the first step warms up, the last one checkpoints


def report(records: list[dict[str, float]]) -> None:
    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records) / len(records)

    step = mean("timing/step")
    print(f"\nmean over steps {int(records[0]['step'])}..{int(records[-1]['step'])}: step {step:.3f} s")
    timed = 0.0
    for phase in PHASES:
        seconds = mean(f"timing/{phase}")
        if seconds:
            timed += seconds
            print(f"  {phase:<16} {seconds:8.3f} s  {seconds / step:6.1%}")
    untimed = step - timed
    print(f"  {'(untimed)':<16} {untimed:8.3f} s  {untimed / step:6.1%}")
    dispatch = mean("timing/dispatch")
    print(f"  {'dispatch':<16} {dispatch:8.3f} s  {dispatch / step:6.1%}  (inside the phases)")
    overhead = dispatch + mean("timing/adv") + untimed
    print(f"driver overhead share: {overhead / step:.3f}")
    print(f"throughput: {mean('perf/tokens_per_s'):.0f} tokens/s")
    report_handover(mean, step)


def report_handover(mean: Callable[[str], float], step: float) -> None:
    """Seconds per step of each hand-over phase and its pieces, and the hand-over's share of the step."""
    print("hand-over (colocated sleep/wake + weight sync), seconds per step:")
    total = 0.0
    for phase, pieces in HANDOVER.items():
        seconds = mean(f"timing/{phase}")
        total += seconds
        print(f"  {phase:<38} {seconds:8.3f} s  {seconds / step:6.1%}")
        rest = seconds
        for label, keys in pieces:
            piece = sum(mean(key) for key in keys)
            rest -= piece
            print(f"    {label:<36} {piece:8.3f} s")
        print(f"    {'rest (checks, Ray calls, ref/critic)':<36} {rest:8.3f} s")
    print(f"  {'total':<38} {total:8.3f} s  {total / step:6.1%}")
    print(f"hand-over share {total / step:.2f} (goal ≤ {HANDOVER_GOAL:.2f})")


if __name__ == "__main__":
    main()
