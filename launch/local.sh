#!/usr/bin/env bash
# megarl-train on this machine (one node): sets up .venv (with the `gpu` extra where nvidia-smi finds
# GPUs), fills trainer.devices_per_node with the GPU count nvidia-smi reports (unless given) and tees
# the output to a log.
#   bash launch/local.sh +experiment=qwen2_5_7b_tp4 model.path=/models/Qwen2.5-7B-Instruct
# Ray starts inside megarl-train unless RAY_ADDRESS names a running cluster. Knobs:
#   MEGARL_LOG_DIR   where local-<time>.log goes [logs]
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  export MEGARL_GPU=${MEGARL_GPU:-1}
fi
bash launch/setup_env.sh
# shellcheck source=/dev/null
source .venv/bin/activate
overrides=("$@")
if command -v nvidia-smi >/dev/null && [[ " ${overrides[*]} " != *" trainer.devices_per_node="* ]]; then
  overrides+=("trainer.devices_per_node=$(nvidia-smi -L | wc -l)")
fi
log_dir=${MEGARL_LOG_DIR:-logs}
mkdir -p "$log_dir"
log=$log_dir/local-$(date +%Y%m%d-%H%M%S).log
echo "local.sh: megarl-train ${overrides[*]} (log: $log)"
megarl-train "${overrides[@]}" 2>&1 | tee "$log"
