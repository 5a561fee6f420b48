#!/usr/bin/env bash
# Create .venv (once) and install megarl with its dev tools into it, under launch/constraints-cpu.txt
# (torch's CPU build); with MEGARL_GPU=1 the `gpu` extra instead (sglang 0.5.23 and its CUDA torch), then
# the `te` extra (TransformerEngine) without build isolation: its torch extension compiles against the torch
# just installed and needs nvcc (CUDA_HOME). Idempotent: pip runs again only when setup.py, the constraints or
# MEGARL_GPU changed since the last successful install. PYTHON picks the interpreter (>= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup_env: $python is $("$python" --version 2>&1); megarl needs Python >= 3.11 (set PYTHON=...)" >&2
  exit 1
}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.megarl-installed
if [ "${MEGARL_GPU:-0}" = 1 ]; then
  install=(-e ".[dev,gpu]")
else
  install=(-e ".[dev]" -c launch/constraints-cpu.txt)
fi
want=$( (cat setup.py launch/constraints-cpu.txt; echo "gpu=${MEGARL_GPU:-0}") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "${install[@]}"
  if [ "${MEGARL_GPU:-0}" = 1 ]; then
    command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ] || {
      echo "setup_env: TransformerEngine's torch extension needs the CUDA 13 toolkit: put nvcc on PATH or set" \
        "CUDA_HOME (launch/README.md, 'What a GPU node needs')" >&2
      exit 1
    }
    .venv/bin/python -m pip install --quiet setuptools wheel ninja
    .venv/bin/python -m pip install --quiet --no-build-isolation -e ".[te]"
  fi
  echo "$want" > "$stamp"
fi
