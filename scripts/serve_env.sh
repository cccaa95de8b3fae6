#!/usr/bin/env bash
# Create a serving-only environment (default: .venv-serve): the project and what `bert-serve`
# needs for the tvm backend, at requirements.lock's versions. No torch, no transformers, and TVM's
# compiler library (libtvm_compiler.so, ~250 MB) removed: the server loads TVM's runtime only.
# The Docker image's runtime stage is built by this script. Needs Python 3.11+ (tomllib).
# Usage: scripts/serve_env.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    -h|--help) sed -n '2,6p' "$0" | cut -c3-; exit 0 ;;
    -*) echo "serve_env.sh: unknown option '$1'; usage: scripts/serve_env.sh [DIR]" >&2; exit 2 ;;
esac
VENV=${1:-.venv-serve}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
"$VENV/bin/python" -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
    > "$requirements"
"$VENV/bin/python" -m pip install --quiet --no-cache-dir -c requirements.lock -r "$requirements"
"$VENV/bin/python" -m pip install --quiet --no-cache-dir --no-deps .
rm -rf build/lib build/bdist.*  # setuptools' copies of the sources, not the project's build/ logs
rm -f "$VENV"/lib/python3*/site-packages/tvm/lib/libtvm_compiler.so
