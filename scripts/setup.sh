#!/usr/bin/env bash
# Create .venv (if needed) and install the pinned dependencies and the project. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed-$(cat requirements.lock requirements-nodeps.lock pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.lock
  .venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.lock  # the tests' reference libraries
  .venv/bin/python -m pip install --quiet --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
