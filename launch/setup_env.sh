#!/usr/bin/env bash
# Create .venv (once) and install megarl with its dev tools into it. Idempotent: pip runs again only
# when setup.py changed since the last successful install. PYTHON picks the interpreter (>= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup_env: $python is $("$python" --version 2>&1); megarl needs Python >= 3.11 (set PYTHON=...)" >&2
  exit 1
}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.megarl-installed
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  echo "$want" > "$stamp"
fi
