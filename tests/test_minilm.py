"""The real all-MiniLM-L6-v2: every CPU library matches PyTorch; CUDA compiles without a GPU."""

from pathlib import Path

import numpy as np
import pytest
import tvm

from artifact.loader import load_artifact
from artifact.manifest import Manifest
from compile.checkpoint import example_inputs
from tests.support.artifacts import compile_artifact

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


CUDA_BUCKETS = [(1, 16), (8, 128), (32, 128), (64, 512)]  # configs/cuda.yaml's


# fp16 with CUDA graphs (the tensor-core path) at the config's largest bucket: the smaller ones
# build as the fp32 run shows
@pytest.mark.parametrize("flags,buckets", [(["--dtype", "float32"], CUDA_BUCKETS),
                                           (["--dtype", "float16", "--cuda-graph", "--buckets", "64x512"],
                                            CUDA_BUCKETS[-1:])])
def test_cuda_config_compiles_every_bucket_without_a_gpu(flags, buckets, tmp_path):
    """configs/cuda.yaml as shipped: every bucket and the generic library, in fp32, and in fp16
    with CUDA graphs; `auto` builds only concat when there is no GPU to time on."""
    from compile.cli import main

    out = tmp_path / "cuda"
    assert main(["--config", str(REPO / "configs" / "cuda.yaml"), *flags, "--strategy", "auto", "--quiet",
                 "--out", str(out)]) == 0
    manifest = Manifest.read(out)
    assert manifest.target.kind == "cuda" and manifest.target.cuda_arch == "sm_90"
    assert manifest.dtype == flags[1] and manifest.target.cuda_graph == ("--cuda-graph" in flags)
    assert [(b.batch, b.seq) for b in manifest.buckets] == buckets
    assert {b.strategy for b in manifest.buckets} == {"concat"} and list(manifest.weights) == ["concat"]
    for entry in [*manifest.buckets, manifest.generic]:
        assert (out / entry.library).stat().st_size > 0
    assert manifest.validated == tvm.cuda(0).exist


def test_cuda_float16_with_cuda_graphs_compiles_without_a_gpu(tiny_bert_dir, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "cuda-fp16"
    manifest, _ = compile_artifact(tiny_bert_dir, out, ["2x8"], target="cuda", dtype="float16", cuda_graph=True)
    assert manifest.dtype == "float16" and manifest.target.cuda_graph
    assert manifest.tolerance == 2e-2
    weights = load_file(str(out / manifest.weights["concat"].file))
    half = [w for w in weights.values() if w.dtype.name == "float16"]
    assert len(half) == 2 * 4  # every matmul weight (QKV, attention out, FFN in/out) of both layers
    assert all(w.ndim == 2 for w in half)  # biases and layer norms stay float32 (ToMixedPrecision)
    assert (out / manifest.buckets[0].library).stat().st_size > 0
