#!/usr/bin/env bash
# The GPU results in docs/bench/cuda. CUDA libraries compile on any machine (no GPU needed) but
# run only on one, and the lent GPU machine has no TVM compiler and reaches no package index, so:
#   compile  (here)  the default model for CUDA in fp32 and fp16, each with CUDA graphs and without
#   pack     (here)  artifacts + checkpoint + TVM runtime + wheels into .gpu/ (scripts/gpu_transport.py)
#   unpack   (GPU)   rebuild everything under /tmp/site and artifacts/, checked by sha256
#   verify   (GPU)   tests/test_cuda.py, then every library against PyTorch on the GPU, recorded in
#                    each manifest (compile.verify --record); manifests copied to $OUT
#   bench    (GPU)   per dtype: TVM (graph, and plain via --compare) vs PyTorch eager and torch.compile
# Usage: scripts/gpu_bench.sh STAGE [DTYPE]; PYTHON, ARTIFACTS, OUT, REPEATS, CUDA_ARCH override.
set -euo pipefail
cd "$(dirname "$0")/.."
ARTIFACTS=${ARTIFACTS:-artifacts}
OUT=${OUT:-docs/bench/cuda}
REPEATS=${REPEATS:-30}
CUDA_ARCH=${CUDA_ARCH:-sm_90}
SITE=${SITE:-/tmp/site}
stage=${1:?stage: compile, pack, unpack, verify or bench}

if [[ $stage == compile || $stage == pack ]]; then
  PYTHON=${PYTHON:-.venv/bin/python}
else  # the GPU machine: its own Python (with torch), our wheels and TVM's runtime first on the path
  PYTHON=${PYTHON:-python3}
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
fi
variants=(cuda-float32-graph cuda-float32-plain cuda-float16-graph cuda-float16-plain)

case $stage in
  compile)
    for dtype in float32 float16; do
      "$PYTHON" -m compile --config configs/cuda.yaml --cuda-arch "$CUDA_ARCH" --dtype "$dtype" --strategy concat \
        --cuda-graph --out "$ARTIFACTS/cuda-$dtype-graph"
      "$PYTHON" -m compile --config configs/cuda.yaml --cuda-arch "$CUDA_ARCH" --dtype "$dtype" --strategy concat \
        --out "$ARTIFACTS/cuda-$dtype-plain"
    done ;;
  pack)
    "$PYTHON" scripts/gpu_transport.py pack "${variants[@]/#/--artifacts=$ARTIFACTS/}" --out .gpu ;;
  unpack)
    "$PYTHON" scripts/gpu_transport.py unpack "${2:?packed directory}" --site "$SITE" --artifacts-dir "$ARTIFACTS" ;;
  verify)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    BERT_CUDA_ARTIFACTS=$ARTIFACTS "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
    mkdir -p "$OUT"
    for variant in "${variants[@]}"; do
      "$PYTHON" -m compile.verify --artifacts "$ARTIFACTS/$variant" --record
      cp "$ARTIFACTS/$variant/manifest.json" "$OUT/$variant.manifest.json"
    done ;;
  bench)
    dtype=${2:?dtype: float32 or float16}
    "$PYTHON" -m loadtest.bench --artifacts "$ARTIFACTS/cuda-$dtype-graph" --compare "$ARTIFACTS/cuda-$dtype-plain" \
      --shapes 1x16,8x128,32x128,64x512 --generic-shapes 5x100,24x200 --torch-compile \
      --repeats "$REPEATS" --out "$OUT/$dtype" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
