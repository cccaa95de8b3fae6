"""The real all-MiniLM-L6-v2: every CPU library matches PyTorch; CUDA compiles without a GPU."""

from pathlib import Path

import numpy as np
import pytest
import tvm

from artifact.loader import load_artifact
from artifact.manifest import Manifest
from compile.checkpoint import example_inputs

pytestmark = pytest.mark.slow  # collected first: see conftest.py

REPO = Path(__file__).resolve().parents[1]


def test_every_minilm_library_matches_pytorch(minilm_artifact):
    manifest = Manifest.read(minilm_artifact)
    assert manifest.validated and manifest.pooling == "mean" and manifest.output_dim == 384
    assert manifest.passes.before.matmul == 48 and manifest.passes.strategies["concat"].after.matmul == 36
    assert [(b.batch, b.seq) for b in manifest.buckets] == [(1, 16), (4, 32)]
    assert all(b.max_abs_diff is not None and b.max_abs_diff <= 1e-4 for b in manifest.buckets)
    assert sorted(manifest.generic.max_abs_diff) == ["2x45", "3x20", "5x9"]
    assert all(d is not None and d <= 1e-4 for d in manifest.generic.max_abs_diff.values())


def test_minilm_padding_to_a_bucket_does_not_change_embeddings(minilm_artifact):
    model = load_artifact(minilm_artifact)
    input_ids, attention_mask, _, _ = (x.numpy() for x in example_inputs(3, 11, 30522, seed=5))
    bucketed = model.run(input_ids, attention_mask)
    assert bucketed.path == "bucket-4x32"
    unpadded = model.generic(input_ids, attention_mask, np.zeros_like(input_ids),
                             np.broadcast_to(np.arange(11), (3, 11)))
    np.testing.assert_allclose(bucketed.output, unpadded, atol=1e-5)


CUDA_BUCKETS = ["1x16", "8x128", "32x128", "64x512"]  # configs/cuda.yaml's


def _compile_cuda_config(out: Path, *flags: str) -> Manifest:
    """configs/cuda.yaml with `flags` on top, through the CLI, on a machine without a GPU: `auto` builds
    only concat (there is no GPU to time on), each bucket's library and the generic one."""
    from compile.cli import main

    assert main(["--config", str(REPO / "configs" / "cuda.yaml"), *flags, "--strategy", "auto", "--quiet",
                 "--out", str(out)]) == 0
    manifest = Manifest.read(out)
    assert manifest.target.kind == "cuda" and manifest.target.cuda_arch == "sm_90"
    assert {b.strategy for b in manifest.buckets} == {"concat"} and list(manifest.weights) == ["concat"]
    for entry in [*manifest.buckets, manifest.generic]:
        assert (out / entry.library).stat().st_size > 0
    assert manifest.validated == tvm.cuda(0).exist
    return manifest


def test_cuda_config_compiles_in_float32_without_a_gpu(tmp_path):
    """configs/cuda.yaml as shipped lists its four buckets; in fp32 its smallest bucket and the generic
    library build (the other buckets differ from it in their static sizes only; the largest is built in
    fp16 below)."""
    from compile.config import load_config

    assert load_config(REPO / "configs" / "cuda.yaml", {}).buckets == CUDA_BUCKETS
    manifest = _compile_cuda_config(tmp_path / "cuda", "--dtype", "float32", "--buckets", CUDA_BUCKETS[0])
    assert manifest.dtype == "float32" and not manifest.target.cuda_graph
    assert [f"{b.batch}x{b.seq}" for b in manifest.buckets] == CUDA_BUCKETS[:1]


def test_cuda_float16_with_cuda_graphs_compiles_without_a_gpu(tmp_path):
    """fp16 with CUDA graphs (the tensor-core path) at the config's largest bucket: every matmul weight
    ships in half precision, biases and layer norms in float32, checked to fp16's tolerance."""
    from safetensors.numpy import load_file

    out = tmp_path / "cuda-fp16"
    manifest = _compile_cuda_config(out, "--dtype", "float16", "--cuda-graph", "--buckets", CUDA_BUCKETS[-1])
    assert manifest.dtype == "float16" and manifest.target.cuda_graph
    assert [f"{b.batch}x{b.seq}" for b in manifest.buckets] == CUDA_BUCKETS[-1:]
    assert manifest.tolerance == 2e-2
    weights = load_file(str(out / manifest.weights["concat"].file))
    half = [w for w in weights.values() if w.dtype.name == "float16"]
    assert len(half) == 6 * 4  # every matmul weight (QKV, attention out, FFN in/out) of the six layers
    assert all(w.ndim == 2 for w in half)  # biases and layer norms stay float32 (ToMixedPrecision)
