#!/usr/bin/env bash
# The main job on a CPU machine: set up .venv, write GSM8K parquet files, run megarl-train with the
# CPU demo config. Extra arguments are Hydra overrides, e.g. `bash launch/demo_cpu.sh rollout.n=8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
for split in train test; do
  out=data/processed/gsm8k/$split.parquet
  [ -f "$out" ] || megarl-preprocess gsm8k --input "data/gsm8k/$split.jsonl" --output "$out"
done
megarl-train --config-name demo_cpu "$@"
