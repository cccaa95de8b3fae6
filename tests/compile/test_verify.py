"""`python -m compile.verify` and runtime-only TVM: what a serving machine without the compiler runs.

Each check runs in a subprocess with `TVM_USE_RUNTIME_LIB=1`, so TVM loads only libtvm_runtime
(as on a machine whose TVM has no compiler library) and any import of compiler-only Python
(tvm.relax, the importer) fails the test.
"""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np

from artifact.manifest import Manifest
from tests.support.commands import run_verify


def test_verify_records_every_library_with_the_runtime_alone(tiny_embed_artifact, tmp_path):
    artifact = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, artifact)
    data = json.loads((artifact / "manifest.json").read_text())
    data.update(validated=False, validated_on=None)  # as a CUDA artifact compiled without a GPU
    for bucket in data["buckets"]:
        bucket["max_abs_diff"] = None
    data["generic"]["max_abs_diff"] = dict.fromkeys(data["generic"]["max_abs_diff"])
    (artifact / "manifest.json").write_text(json.dumps(data))

    result = run_verify("--artifacts", str(artifact), "--record")
    assert result.returncode == 0, result.stderr
    assert "bucket_4x16: 4x16" in result.stdout
    manifest = Manifest.read(artifact)
    assert manifest.validated and manifest.validated_on == "cpu"
    assert all(b.max_abs_diff is not None and b.max_abs_diff <= 1e-4 for b in manifest.buckets)
    assert sorted(manifest.generic.max_abs_diff) == ["2x11", "3x5", "5x20"]
    assert all(d is not None and d <= 1e-4 for d in manifest.generic.max_abs_diff.values())
    # what compile measured and recorded survives the rewrite
    before = Manifest.read(tiny_embed_artifact)
    assert manifest.target.cpu_features == before.target.cpu_features
    assert [b.latency_ms for b in manifest.buckets] == [b.latency_ms for b in before.buckets]
    assert manifest.generic.cost_model == before.generic.cost_model


def test_verify_fails_when_a_library_disagrees_with_pytorch(tiny_embed_artifact, tmp_path):
    artifact = tmp_path / "copy"
    shutil.copytree(tiny_embed_artifact, artifact)
    data = json.loads((artifact / "manifest.json").read_text())
    data["tolerance"] = 0.0  # float32 kernels never match PyTorch bit for bit
    (artifact / "manifest.json").write_text(json.dumps(data))
    result = run_verify("--artifacts", str(artifact), "--record")
    assert result.returncode == 1
    assert "FAILED: bucket 1x8 at 1x8: max |tvm - torch|" in result.stderr
    assert json.loads((artifact / "manifest.json").read_text()) == data  # nothing recorded


def test_verify_refuses_what_is_not_an_artifact(tmp_path):
    result = run_verify("--artifacts", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"verify: error: {tmp_path} is not an artifact directory: no manifest.json"


def test_server_runs_with_the_tvm_runtime_alone(tiny_embed_artifact, serve):
    from artifact.loader import load_artifact

    text_ids = np.array([[101, 7592, 2088, 102]])
    expected = load_artifact(tiny_embed_artifact).run(text_ids, np.ones_like(text_ids)).output[0]
    with serve([tiny_embed_artifact], env={"TVM_USE_RUNTIME_LIB": "1"}) as server:
        response = httpx.post(f"{server.url}/embed", json={"inputs": "hello world", "normalize": False}, timeout=30)
        assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()[0], expected, atol=1e-5)
