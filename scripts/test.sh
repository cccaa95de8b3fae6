#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per CPU (`nproc`), each taking whole files (a file's fixtures are built once); the slow files
# are collected first (tests/conftest.py) so that no worker is left with one at the end. xdist would hand
# the files out by their number of tests instead (a slow file with few tests last): --no-loadscope-reorder
# keeps the collected order.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-$(nproc)}" --dist loadfile --no-loadscope-reorder "$@"
