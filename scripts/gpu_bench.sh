#!/usr/bin/env bash
# The CUDA measurements of docs/CUDA.md, on any GPU host. CUDA libraries compile on any
# machine (no GPU needed) but run only on a GPU, so the stages say where they run:
#   compile       (anywhere)  configs/cuda.yaml in fp32 and fp16, each with CUDA graphs and without,
#                             into $ARTIFACTS/cuda-{float32,float16}-{graph,plain}
#   verify        (GPU host)  tests/test_cuda.py, then every library against PyTorch on this GPU,
#                             recorded in each manifest (compile.verify --record), manifests copied to $OUT
#   bench DTYPE   (GPU host)  TVM with CUDA graphs (and without, via --compare) vs PyTorch eager and
#                             torch.compile, at 1x16, 8x128, 32x128, 64x512 and generic 5x100, 24x200
#   serve         (GPU host)  the fp16 CUDA-graph artifact served (one worker: a CUDA artifact's default)
#                             against the PyTorch server on the same GPU, on the load test's traffic
# Environment: PYTHON (.venv/bin/python), ARTIFACTS (artifacts), OUT (docs/bench/cuda),
# REPEATS (30), CUDA_ARCH (sm_90; the GPU's compute capability), MCPU (x86-64-v3: the LLVM CPU of
# the host code, which runs on the GPU host's CPU, not on the compiling machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ARTIFACTS=${ARTIFACTS:-artifacts}
OUT=${OUT:-docs/bench/cuda}
REPEATS=${REPEATS:-30}
CUDA_ARCH=${CUDA_ARCH:-sm_90}
MCPU=${MCPU:-x86-64-v3}
USAGE="usage: bash scripts/gpu_bench.sh compile | verify | bench float32|float16 | serve"
variants=(cuda-float32-graph cuda-float32-plain cuda-float16-graph cuda-float16-plain)

require_artifacts() {
  for variant in "$@"; do
    if [[ ! -f $ARTIFACTS/$variant/manifest.json ]]; then
      echo "gpu_bench.sh: $ARTIFACTS/$variant is not a compiled artifact; make it with: bash scripts/gpu_bench.sh compile (on any machine), then copy $ARTIFACTS/ to this one" >&2
      exit 2
    fi
  done
}

case ${1:-} in
  compile)
    for dtype in float32 float16; do
      for graph in graph plain; do
        flags=(--config configs/cuda.yaml --cuda-arch "$CUDA_ARCH" --mcpu "$MCPU" --dtype "$dtype" --strategy concat)
        [[ $graph == graph ]] && flags+=(--cuda-graph)
        "$PYTHON" -m compile "${flags[@]}" --out "$ARTIFACTS/cuda-$dtype-$graph"
      done
    done ;;
  verify)
    require_artifacts "${variants[@]}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    BERT_CUDA_ARTIFACTS=$ARTIFACTS "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
    mkdir -p "$OUT"
    for variant in "${variants[@]}"; do
      "$PYTHON" -m compile.verify --artifacts "$ARTIFACTS/$variant" --record
      cp "$ARTIFACTS/$variant/manifest.json" "$OUT/$variant.manifest.json"
    done ;;
  bench)
    dtype=${2:-}
    if [[ $dtype != float32 && $dtype != float16 ]]; then
      echo "gpu_bench.sh: bench needs a dtype, float32 or float16; $USAGE" >&2; exit 2
    fi
    require_artifacts "cuda-$dtype-graph" "cuda-$dtype-plain"
    "$PYTHON" -m loadtest.bench --artifacts "$ARTIFACTS/cuda-$dtype-graph" --compare "$ARTIFACTS/cuda-$dtype-plain" \
      --shapes 1x16,8x128,32x128,64x512 --generic-shapes 5x100,24x200 --torch-compile \
      --repeats "$REPEATS" --out "$OUT/$dtype" ;;
  serve)
    require_artifacts cuda-float16-graph
    "$PYTHON" -m loadtest.serving_bench --artifacts "$ARTIFACTS/cuda-float16-graph" \
      --only "tvm default (narrow x1 thread + wide),torch default (1 worker x all cores)" \
      --short-requests 60 --long-requests 20 --mixed-requests 200 --rounds 2 --out "$OUT/serving" ;;
  *)
    echo "gpu_bench.sh: unknown stage '${1:-}'; $USAGE" >&2; exit 2 ;;
esac
