#!/usr/bin/env bash
# Set up, compile the default model for this CPU (once), then serve it on 127.0.0.1:8080.
# Extra arguments go to bert-serve (e.g. --port 9000); ARTIFACTS picks another directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ARTIFACTS=${ARTIFACTS:-artifacts/minilm-cpu}
if [ ! -f "$ARTIFACTS/manifest.json" ] && [ ! -f "$ARTIFACTS/levels.json" ]; then
  .venv/bin/bert-compile --config configs/default.yaml --out "$ARTIFACTS"
fi
exec .venv/bin/bert-serve --artifacts "$ARTIFACTS" "$@"
