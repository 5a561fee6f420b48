#!/usr/bin/env bash
# The CPU image demo (docs/vision.md): set up .venv, write the one-shape "which colour is the shape?" images, run the
# supervised format warm-up once (an SFT run on the Megatron stack with images, `+experiment=sft_shapes`: the
# starting checkpoint), then GRPO-train it with configs/demo_vl_cpu.yaml (the plot lands in
# runs/megarl/demo_vl_cpu/metrics.png). Extra arguments are Hydra overrides, e.g.
# `bash launch/demo_vl_cpu.sh trainer.total_training_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
data=data/processed/shapes1
[ -f $data/train.parquet ] ||
  megarl-preprocess shapes --output $data/train.parquet --num-rows 2048 --seed 0 --split train --num-shapes 1
[ -f $data/test.parquet ] ||
  megarl-preprocess shapes --output $data/test.parquet --num-rows 128 --seed 1 --split test --num-shapes 1
[ -f $data/sft.parquet ] ||
  megarl-preprocess shapes-sft --output $data/sft.parquet --num-rows 3200 --seed 0 --num-shapes 1 --answer-pool palette
[ -f runs/warmup/tiny_qwen2_5_vl_shapes/config.json ] ||
  megarl-train trainer.mode=sft +experiment=sft_shapes
megarl-train --config-name demo_vl_cpu "$@"
