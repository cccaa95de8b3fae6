"""CUDA artifacts of the real MiniLM on a real GPU: validated against PyTorch there, served on cuda:0.

CUDA libraries compile anywhere (test_minilm.py compiles them here, without a GPU) but run only
where a GPU is. The GPU tests take artifacts compiled beforehand (`bash scripts/gpu_bench.sh
compile`) from the directory in BERT_CUDA_ARTIFACTS and need only TVM's runtime; they are
skipped where there is no CUDA device or no such directory. `bash scripts/gpu_bench.sh verify`
runs them on the GPU host. The tests of scripts/gpu_bench.sh itself run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from artifact.loader import device_for

ROOT = Path(__file__).resolve().parents[1]
GPU_BENCH = ROOT / "scripts" / "gpu_bench.sh"
ARTIFACTS = Path(os.environ.get("BERT_CUDA_ARTIFACTS", "/nonexistent"))
needs_gpu = pytest.mark.skipif(
    not (ARTIFACTS / "cuda-float32-graph").is_dir() or not device_for("cuda").exist,
    reason="needs a CUDA device and BERT_CUDA_ARTIFACTS",
)

TEXTS = ["the GPU serves this", "a second, slightly longer sentence to embed on cuda:0 " * 3, "three", "🙂 mixed 漢字"]


@needs_gpu
@pytest.mark.parametrize(("name", "bound"), [("cuda-float32-graph", 1e-4), ("cuda-float32-plain", 1e-4),
                                             ("cuda-float16-graph", 2e-2), ("cuda-float16-plain", 2e-2)])
def test_every_library_matches_pytorch_on_the_gpu(name, bound):
    from artifact.manifest import Manifest
    from compile.verify import verify

    manifest = Manifest.read(ARTIFACTS / name)
    assert manifest.tolerance == bound
    diffs = verify(ARTIFACTS / name)
    values = [d for shapes in diffs.values() for d in shapes.values()]
    assert len(values) == len(manifest.buckets) + len(manifest.generic.max_abs_diff)
    assert all(0 <= d <= bound for d in values)


@needs_gpu
def test_cuda_graph_bucket_replays_the_same_numbers():
    from artifact.loader import load_artifact
    from compile.checkpoint import example_inputs

    model = load_artifact(ARTIFACTS / "cuda-float32-graph")
    assert model.manifest.target.cuda_graph
    ids, mask, _, _ = (x.numpy() for x in example_inputs(5, 100, 30522, seed=3))
    first, second = model.run(ids, mask), model.run(ids, mask)
    assert first.path == "bucket-8x128"
    np.testing.assert_array_equal(first.output, second.output)
    generic = model.generic(ids, mask, np.zeros_like(ids), np.broadcast_to(np.arange(100), ids.shape))
    np.testing.assert_allclose(first.output, generic, atol=1e-4)  # padding to the bucket changes nothing


@needs_gpu
def test_threads_capturing_cuda_graphs_at_once_get_the_one_thread_numbers():
    """Each thread's VM captures its CUDA graph on its first call, as a server's lanes do, while
    the other threads run theirs: no capture may see another thread's work."""
    from artifact.loader import load_artifact
    from compile.checkpoint import example_inputs

    model = load_artifact(ARTIFACTS / "cuda-float16-graph")
    batches = [tuple(x.numpy() for x in example_inputs(b, s, 30522, seed=b)[:2]) for b, s in ((1, 16), (6, 120))]
    expected = [model.run(ids, mask).output for ids, mask in batches]
    start = threading.Barrier(8)

    def lane(index: int) -> list[np.ndarray]:
        start.wait()
        return [model.run(*batches[(index + i) % 2]).output for i in range(4)]

    with ThreadPoolExecutor(8) as pool:
        for index, outputs in enumerate(pool.map(lane, range(8))):
            for i, output in enumerate(outputs):
                np.testing.assert_array_equal(output, expected[(index + i) % 2])


@needs_gpu
def test_tvm_and_torch_servers_on_the_gpu_match_sentence_transformers(serve):
    from sentence_transformers import SentenceTransformer

    from artifact.manifest import Manifest

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


def test_benchmarks_describe_their_machine_with_tvms_runtime_only():
    """A GPU host may carry TVM's runtime without its compiler (`TVM_USE_RUNTIME_LIB=1`), where
    LLVM, which names the CPU, is absent: the machine line written beside every benchmark figure
    (`python -m loadtest.bench`, `loadtest.serving_bench`) must still be written. Runs everywhere."""
    code = ("import json; from loadtest.machine import describe, line; "
            "d = describe(); print(json.dumps(d)); print(line(d))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"})
    assert result.returncode == 0, result.stderr
    report, text = result.stdout.splitlines()
    machine = json.loads(report)
    assert machine["llvm_mcpu"] is None and machine["cores"] >= 1 and machine["cpu"]
    assert text.startswith(f"{machine['cpu']} (LLVM mcpu n/a, {machine['cores']} cores, ")


# ----------------------------------------------------------------------------- scripts/gpu_bench.sh


def _gpu_bench(*args: str, artifacts: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_BENCH), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ARTIFACTS": str(artifacts)})


def test_every_gpu_bench_stage_named_in_the_docs_exists():
    """The stages README.md, docs/CUDA.md, this file and the script's usage line run
    (`bash scripts/gpu_bench.sh STAGE`) are the ones its `case` handles."""
    script = GPU_BENCH.read_text()
    stages = set(re.findall(r"^  ([a-z0-9-]+)\)$", script, re.M))
    assert stages == {"compile", "verify", "bench", "serve"}
    for source in (ROOT / "README.md", ROOT / "docs" / "CUDA.md", Path(__file__), GPU_BENCH):
        named = set(re.findall(r"bash\s+scripts/gpu_bench\.sh\s+([a-z][a-z0-9-]*)", source.read_text()))
        assert named <= stages, f"{source.name} names gpu_bench.sh stages {sorted(named - stages)} it does not have"


@pytest.mark.parametrize("argv", [[], ["device"], ["bench"], ["bench", "float64"]])
def test_gpu_bench_usage_errors_are_one_line_and_exit_2(argv, tmp_path):
    result = _gpu_bench(*argv, artifacts=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("gpu_bench.sh: ") and line.endswith("usage: bash scripts/gpu_bench.sh compile | verify | "
                                                              "bench float32|float16 | serve")


@pytest.mark.parametrize(("argv", "first_missing"), [(["verify"], "cuda-float32-graph"),
                                                     (["bench", "float16"], "cuda-float16-graph"),
                                                     (["serve"], "cuda-float16-graph")])
def test_gpu_stages_without_compiled_artifacts_say_how_to_make_them(argv, first_missing, tmp_path):
    """Before touching the GPU, each artifact the stage reads must be there (here: a directory
    without a manifest, as an interrupted copy leaves it)."""
    (tmp_path / first_missing).mkdir()
    result = _gpu_bench(*argv, artifacts=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"gpu_bench.sh: {tmp_path}/{first_missing} is not a compiled artifact; make it with: "
                             f"bash scripts/gpu_bench.sh compile (on any machine), then copy {tmp_path}/ to this one\n")
