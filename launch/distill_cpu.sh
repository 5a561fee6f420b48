#!/usr/bin/env bash
# On-policy distillation on the CPU demo's task, after `bash launch/demo_cpu.sh` (which leaves the GRPO-trained actor
# in runs/megarl/demo_cpu/checkpoints and the format-only warm-up in runs/warmup/tiny_dense_largest): the demo's
# final actor is converted to HF as the teacher (runs/teacher/largest), and the warm-up, as the student, distils from
# it on the same task with the demo's settings (`+experiment=distill_largest`; runs/megarl/distill_largest/).
# Extra arguments are Hydra overrides, e.g. `bash launch/distill_cpu.sh trainer.total_training_steps=40`.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
latest=runs/megarl/demo_cpu/checkpoints/$(cat runs/megarl/demo_cpu/checkpoints/latest)
[ -f runs/teacher/largest/config.json ] ||
  megarl-convert mcore-to-hf --mcore "$latest/actor/model" --hf-config runs/warmup/tiny_dense_largest --out runs/teacher/largest
megarl-train --config-name demo_cpu +experiment=distill_largest "$@"
