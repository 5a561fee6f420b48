#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv, then lint (ruff), type-check (mypy on
# megarl/) and run pytest, two test files at a time in the order tests/conftest.py gives them, slowest first
# (pytest-xdist; by default it would start the files with the most tests first; MEGARL_TEST_WORKERS=1 runs them one by
# one). Extra arguments go to pytest, e.g. `bash tests/run.sh -k protocol`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ruff check .
ruff format --check .
mypy
pytest -n "${MEGARL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
