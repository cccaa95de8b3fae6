"""A tvm-backend server carries the model, not the compiler: no torch, no transformers, no TVM
compiler library mapped into the process (read from /proc), and /info reports its memory."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

COMPILE_ONLY = ("libtorch", "libtvm_compiler", "transformers")


def mapped_files(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from Linux /proc")
def test_tvm_server_maps_no_torch_and_no_tvm_compiler(serve, tiny_embed_artifact):
    with serve([tiny_embed_artifact], "--workers", "1") as server:
        assert httpx.post(f"{server.url}/embed", json={"inputs": "still answers"}, timeout=60).status_code == 200
        files = mapped_files(server.process.pid)
        assert any("libtvm_runtime" in name for name in files)  # the check reads what it should
        assert not [name for name in files if any(part in name for part in COMPILE_ONLY)]
        info = httpx.get(f"{server.url}/info").json()
        weights = sum(f.stat().st_size for f in Path(tiny_embed_artifact).glob("weights-*.safetensors"))
        assert info["memory"]["weights_bytes"] == info["models"][0]["weights_bytes"] == weights
        assert info["memory"]["rss_bytes"] > weights


def test_torch_backend_still_loads_torch(serve, tiny_embed_artifact):
    """...and reports the weights PyTorch holds (the checkpoint's tensors), not the artifact's files."""
    import json

    from safetensors import safe_open

    with serve([tiny_embed_artifact], "--backend", "torch", "--workers", "1") as server:
        assert any("libtorch" in name for name in mapped_files(server.process.pid))
        info = httpx.get(f"{server.url}/info").json()
    checkpoint = Path(json.loads((Path(tiny_embed_artifact) / "manifest.json").read_text())["model"]["path"])
    with safe_open(str(checkpoint / "model.safetensors"), "np") as tensors:
        held = sum(tensors.get_tensor(name).nbytes for name in tensors.keys())
    assert info["memory"]["weights_bytes"] == info["models"][0]["weights_bytes"] == held


def test_torch_backend_without_torch_exits_2_with_one_line(tmp_path, tiny_embed_artifact):
    """Where torch is not installed (a serving-only environment, the Docker image), `--backend torch`
    is refused before listening, not failed in the background after start-up."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(tiny_embed_artifact),
                             "--backend", "torch", "--port", "0"], capture_output=True, text=True, timeout=120,
                            env=env, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "--backend torch needs torch" in result.stderr
