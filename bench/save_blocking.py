"""How long a checkpoint holds up its step (issue 41: goal ≤ 10% of a step): the CPU demo (`configs/demo_cpu.yaml`,
from the SFT warm-up in runs/warmup/tiny_dense_largest, or `model=tiny_dense` without it) run twice in one go,
with trainer.async_save=true and then false, a checkpoint every `--save-freq` steps, and per run: the median step
time of the steps without a save, the mean `timing/save_checkpoint` of the steps with one (what the step waited
for: staging the state with async_save, the whole write without), their ratio, and the ratio of the two runs.

    .venv/bin/python bench/save_blocking.py [--steps 30] [--save-freq 10] [overrides ...]
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
WARMUP_MODEL = REPO / "runs/warmup/tiny_dense_largest/config.json"
GOAL = 0.10


def run(run_dir: Path, args: argparse.Namespace, asynchronous: bool) -> tuple[float, float]:
    """(median step time without a save, mean blocking time of a save) of one run of the demo."""
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.save_freq}",
        f"trainer.async_save={str(asynchronous).lower()}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress_bar=false",
        "trainer.logger=[console]",
        *([] if WARMUP_MODEL.is_file() else ["model=tiny_dense"]),
        *args.overrides,
    ]
    train = Path(sys.executable).with_name("megarl-train")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(train), "--config-name", "demo_cpu", *overrides], check=True, cwd=REPO, env=env)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [r["timing/save_checkpoint"] for r in records if "timing/save_checkpoint" in r]
    steps = [r["timing/step"] for r in records[1:] if "timing/save_checkpoint" not in r]  # step 1 warms up
    return statistics.median(steps), statistics.mean(saves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="extra megarl-train overrides")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="megarl-bench-save") as tmp:
        for asynchronous in (True, False):
            results[asynchronous] = run(Path(tmp) / f"async_{asynchronous}", args, asynchronous)
    print(f"\n{args.steps} steps, a checkpoint every {args.save_freq}:")
    for asynchronous, (step, save) in results.items():
        print(
            f"  async_save={str(asynchronous).lower():<5}  step {step:.3f} s  save blocks {save:.3f} s  "
            f"ratio {save / step:.3f}"
        )
    ratio = results[True][1] / results[False][1]
    print(
        f"asynchronous save blocks {ratio:.3f}× as long as the synchronous one; "
        f"its share of a step {results[True][1] / results[True][0]:.3f} (goal ≤ {GOAL:.2f})"
    )


if __name__ == "__main__":
    main()
