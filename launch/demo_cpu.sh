#!/usr/bin/env bash
# The main job on a CPU machine: set up .venv, write the demo's parquet files (the "largest of five
# numbers" task; addition and GSM8K too, for `data=arith` / `data=gsm8k`), run the supervised format
# warm-up once (an SFT run on the Megatron stack, `+experiment=sft_largest`: the starting checkpoint), then
# GRPO-train it with the CPU demo config (the plot lands in runs/megarl/demo_cpu/metrics.png). Extra arguments are Hydra overrides,
# e.g. `bash launch/demo_cpu.sh trainer.total_training_steps=50`. The engines run batch-invariant
# (`rollout.deterministic_inference=true`), so the run repeats bit for bit on one machine (README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
for split in train test; do
  out=data/processed/gsm8k/$split.parquet
  [ -f "$out" ] || megarl-preprocess gsm8k --input "data/gsm8k/$split.jsonl" --output "$out"
done
[ -f data/processed/arith/train.parquet ] ||
  megarl-preprocess arith --output data/processed/arith/train.parquet --num-rows 2048 --seed 0 --split train
[ -f data/processed/arith/test.parquet ] ||
  megarl-preprocess arith --output data/processed/arith/test.parquet --num-rows 64 --seed 1 --split test
[ -f data/processed/largest/train.parquet ] ||
  megarl-preprocess largest --output data/processed/largest/train.parquet --num-rows 2048 --seed 0 --split train
[ -f data/processed/largest/test.parquet ] ||
  megarl-preprocess largest --output data/processed/largest/test.parquet --num-rows 128 --seed 1 --split test
[ -f data/processed/largest/sft.parquet ] ||
  megarl-preprocess largest-sft --output data/processed/largest/sft.parquet --num-rows 3200 --seed 0
[ -f runs/warmup/tiny_dense_largest/config.json ] ||
  megarl-train trainer.mode=sft +experiment=sft_largest
megarl-train --config-name demo_cpu rollout.deterministic_inference=true "$@"
