#!/usr/bin/env bash
# The GPU machine's Python stand-in for `device_check.sh --dry`: a venv (MEGARL_DRY_ENV, by default
# ~/.cache/megarl/gpu-dry, kept across checkouts: it takes minutes to build) of Python 3.12 with exactly the
# image's packages megarl uses (.whl/provided.txt, written by tools/gpu_wheels.sh: torch 2.11, transformers
# 5.17, ...) and pytest, nothing of megarl's own wheels (the check's install step adds those, as on the GPU
# machine). torch 2.11 comes from PyPI as the CUDA build the machine has (about 3 GB; it runs on CPU too).
# Prints the interpreter's path; rebuilt when provided.txt changes. PYTHON312 picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .whl/provided.txt ] || { echo "dry_env: run tools/gpu_wheels.sh first (.whl/provided.txt)" >&2; exit 1; }

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "dry_env: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  return 1
}

venv=${MEGARL_DRY_ENV:-$HOME/.cache/megarl/gpu-dry}
want=$( (cat .whl/provided.txt; echo pytest) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$(find_python312)" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet --no-compile -r .whl/provided.txt pytest setuptools wheel >&2
  echo "$want" > "$venv/.stamp"
fi
echo "$venv/bin/python"
