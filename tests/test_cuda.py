"""CUDA artifacts of the real MiniLM on a real GPU: validated against PyTorch there, served on cuda:0.

CUDA libraries compile anywhere (test_minilm.py compiles them here, without a GPU) but run only
where a GPU is. These tests take artifacts compiled beforehand (`scripts/gpu_bench.sh compile`)
from the directory in BERT_CUDA_ARTIFACTS and need only TVM's runtime; they are skipped where
there is no CUDA device or no such directory (CI). `scripts/gpu_bench.sh device` runs them.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from compile.loader import device_for

ARTIFACTS = Path(os.environ.get("BERT_CUDA_ARTIFACTS", "/nonexistent"))
pytestmark = pytest.mark.skipif(
    not (ARTIFACTS / "cuda-float32-graph").is_dir() or not device_for("cuda").exist,
    reason="needs a CUDA device and BERT_CUDA_ARTIFACTS",
)

TEXTS = ["the GPU serves this", "a second, slightly longer sentence to embed on cuda:0 " * 3, "three", "🙂 mixed 漢字"]


@pytest.mark.parametrize(("name", "bound"), [("cuda-float32-graph", 1e-4), ("cuda-float32-plain", 1e-4),
                                             ("cuda-float16-graph", 2e-2), ("cuda-float16-plain", 2e-2)])
def test_every_library_matches_pytorch_on_the_gpu(name, bound):
    from compile.manifest import Manifest
    from compile.verify import verify

    manifest = Manifest.read(ARTIFACTS / name)
    assert manifest.tolerance == bound
    diffs = verify(ARTIFACTS / name)
    values = [d for shapes in diffs.values() for d in shapes.values()]
    assert len(values) == len(manifest.buckets) + len(manifest.generic.max_abs_diff)
    assert all(0 <= d <= bound for d in values)


def test_cuda_graph_bucket_replays_the_same_numbers():
    from compile.checkpoint import example_inputs
    from compile.loader import load_artifact

    model = load_artifact(ARTIFACTS / "cuda-float32-graph")
    assert model.manifest.target.cuda_graph
    ids, mask, _, _ = (x.numpy() for x in example_inputs(5, 100, 30522, seed=3))
    first, second = model.run(ids, mask), model.run(ids, mask)
    assert first.path == "bucket-8x128"
    np.testing.assert_array_equal(first.output, second.output)
    generic = model.generic(ids, mask, np.zeros_like(ids), np.broadcast_to(np.arange(100), ids.shape))
    np.testing.assert_allclose(first.output, generic, atol=1e-4)  # padding to the bucket changes nothing


def test_tvm_and_torch_servers_on_the_gpu_match_sentence_transformers(serve):
    from sentence_transformers import SentenceTransformer

    from compile.manifest import Manifest

    artifact = ARTIFACTS / "cuda-float32-graph"
    reference = SentenceTransformer(Manifest.read(artifact).model.path, device="cuda").encode(
        TEXTS, normalize_embeddings=True)
    for backend in ("tvm", "torch"):
        with serve([artifact], "--backend", backend) as server:
            response = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers["x-compute-type"] == "cuda"
            info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["models"][0]["target"]["kind"] == "cuda"
        embeddings = np.array(response.json())
        cosines = np.sum(embeddings * reference, axis=1)
        assert cosines.min() >= 0.9999, (backend, cosines)
