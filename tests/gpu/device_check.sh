#!/usr/bin/env bash
# shellcheck disable=SC2329  # the step_* functions run by name (run_step)
# The one command to run on a GPU machine (one H100/H200, offline, minutes of time): installs the carried
# wheels (.whl/, made by tools/gpu_wheels.sh), records the environment, then runs named steps, each under its
# own timeout and inside one overall budget, killing whatever a step leaves running:
#
#   install    the .whl/ wheels and megarl itself (editable, no network, no build isolation)
#   env        python, torch, CUDA, GPU, pip list                                   -> env.txt
#   imports    every megarl module imports
#   gpu_tests  pytest tests/gpu/ (parity vs transformers, embedded engine, IPC, sync, replay)
#                                                                    -> junit.xml, report.jsonl (their numbers)
#   e2e        megarl-train +experiment=device_check: 3 colocated GRPO steps, bf16 -> e2e_metrics.jsonl
#   bench      bench/sync.py on a 1.5B random-init model: tensor and broadcast vs the HBM copy floor
#                                                                    -> bench.json
#
# and writes summary.md (a table: step, result, seconds, the numbers) and log.txt, all into $OUT (or --out DIR,
# else device_check_out/).
#
#   bash tests/gpu/device_check.sh                     # on the GPU machine, from the repository root
#   STEPS="e2e bench" bash tests/gpu/device_check.sh   # rerun some steps on a warm machine
#   bash tests/gpu/device_check.sh --dry               # the same steps on this CPU machine, under Python 3.12,
#                                                      # torch 2.11 and transformers 5.17 (tests/gpu/dry_env.sh)
#
# Environment: STEPS, BUDGET_S (overall seconds: 450, or 3600 with --dry), PYTHON (the interpreter; python3).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
repo=$PWD

dry=0
out=${OUT:-$repo/device_check_out}
while [ $# -gt 0 ]; do
  case $1 in
    --dry) dry=1 ;;
    --out) out=$2; shift ;;
    *) echo "device_check: unknown argument $1 (--dry, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/megarl-check.XXXXXX)
exec > >(tee -a "$out/log.txt") 2>&1

py=${PYTHON:-python3}
budget=${BUDGET_S:-450}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export PYTHONUNBUFFERED=1 MEGARL_CHECK_REPORT=$out/report.jsonl
if [ "$dry" = 1 ]; then
  budget=${BUDGET_S:-3600}
  py=$(bash tests/gpu/dry_env.sh) || exit 1
  export MEGARL_DEVICE_CHECK=dry CUDA_VISIBLE_DEVICES=""
fi
device=$([ "$dry" = 1 ] && echo cpu || echo cuda)
steps=${STEPS:-install env imports gpu_tests e2e bench}
if [[ " $steps " != *" install "* ]] && ! "$py" -c "import ray, megatron.core, megarl" 2>/dev/null; then
  steps="install $steps"  # a fresh machine: nothing runs without the wheels
fi
started=$(date +%s)
: > "$work/steps.tsv"

step_install() {
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl &&
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
}

step_env() {
  {
    date -u
    uname -a
    nvidia-smi || echo "nvidia-smi: not found"
    "$py" -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("transformers", transformers.__version__); [print(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())]'
    "$py" -m pip list --format=freeze
  } > "$out/env.txt" 2>&1
  grep -E "^(torch|transformers|Python|[0-9])" "$out/env.txt" | head -5
}

step_imports() {
  "$py" - <<'EOF'
import importlib, pkgutil, megarl
names = [m.name for m in pkgutil.walk_packages(megarl.__path__, "megarl.")]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(f"imported {len(names) - len(failed)} of {len(names)} megarl modules")
print("\n".join(failed))
raise SystemExit(1 if failed else 0)
EOF
}

step_gpu_tests() {
  "$py" -m pytest tests/gpu -q -o addopts="" -p no:cacheprovider -rfEs --durations=10 --junitxml="$out/junit.xml"
}

step_e2e() {
  local data=$work/data overrides=()
  "$py" -m megarl.cli.preprocess largest --output "$data/train.parquet" --num-rows 256 --seed 0 --split train &&
    "$py" -m megarl.cli.preprocess largest --output "$data/test.parquet" --num-rows 32 --seed 1 --split test ||
    return 1
  [ "$dry" = 1 ] && overrides=(trainer.device=cpu model=tiny_dense)
  "$py" -m megarl.cli.train +experiment=device_check "data.train_files=[$data/train.parquet]" \
    "data.val_files=[$data/test.parquet]" "trainer.run_dir=$work/run" trainer.progress_bar=false "${overrides[@]}"
  local rc=$?
  cp "$work/run/metrics.jsonl" "$out/e2e_metrics.jsonl" || return 1
  return "$rc"
}

step_bench() {
  local model=(--config megarl/assets/models/qwen2_5_1_5b/config.json --bucket-mb 512)
  [ "$dry" = 1 ] && model=(--hidden 256 --layers 4 --bucket-mb 64)
  "$py" bench/sync.py --device "$device" "${model[@]}" --rounds 3 --json "$out/bench.json"
}

declare -A cap=([install]=150 [env]=30 [imports]=90 [gpu_tests]=240 [e2e]=240 [bench]=180)

kill_leftovers() {  # every process that carries this step's marker, whatever session it started
  local marker=$1 environ pid
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    if tr '\0' '\n' 2>/dev/null < "$environ" | grep -qx "MEGARL_CHECK_STEP=$marker"; then
      kill -9 "$pid" 2>/dev/null && echo "device_check: killed $pid left by $marker"
    fi
  done
}

run_step() {
  local name=$1 left limit begin rc
  left=$((budget - ($(date +%s) - started)))
  limit=$((left - 10 < ${cap[$name]} ? left - 10 : ${cap[$name]}))
  if [ "$limit" -lt 20 ]; then
    printf '%s\tskipped: no time left of BUDGET_S=%s\t0\n' "$name" "$budget" >> "$work/steps.tsv"
    return
  fi
  echo "=== $name (limit ${limit}s) ==="
  begin=$(date +%s%N)
  MEGARL_CHECK_STEP=$name-$$ timeout -k 10 "$limit" bash -c "$(declare -f "step_$name"); step_$name"
  rc=$?
  kill_leftovers "$name-$$"
  local tenths result
  tenths=$((($(date +%s%N) - begin) / 100000000))
  case $rc in
    0) result=ok ;;
    124 | 137) result="timeout after ${limit}s" ;;
    *) result="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%d.%d\n' "$name" "$result" $((tenths / 10)) $((tenths % 10)) >> "$work/steps.tsv"
  echo "=== $name: $result ==="
}

export py out work dry device repo
for name in $steps; do
  if [ -z "${cap[$name]:-}" ]; then
    echo "device_check: unknown step $name (install env imports gpu_tests e2e bench)" >&2
    continue
  fi
  run_step "$name"
done
python3 tests/gpu/check_summary.py "$work/steps.tsv" "$out" "$([ "$dry" = 1 ] && echo "dry run on CPU" || echo GPU)"
status=$?
rm -rf "$work"
exit $status
