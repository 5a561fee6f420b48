#!/usr/bin/env bash
# Fill .whl/ (ignored by git; it travels with the working tree to the GPU check machine) with the wheels that
# machine lacks to run megarl, and print the bytes that travel: see tools/gpu_wheels.py. Needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
exec "$python" tools/gpu_wheels.py "$@"
