"""scripts/gpu_transport.py: artifacts go to the GPU machine as checkpoint parts + recipes and
come back byte for byte (every weight file's sha256 as in its manifest), with TVM's runtime only."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from compile.hashing import file_sha256
from compile.loader import load_artifact

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_transport.py"


@pytest.fixture(scope="module")
def transport():
    spec = importlib.util.spec_from_file_location("gpu_transport", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_then_unpack_rebuilds_every_file(transport, tiny_embed_artifact, tmp_path, monkeypatch):
    site_packages = tmp_path / "site-packages"
    (site_packages / "tvm" / "lib").mkdir(parents=True)
    for library in ("libtvm_runtime.so", "libtvm_compiler.so"):
        (site_packages / "tvm" / "lib" / library).write_bytes(b"\x7fELF stand-in")
    (tmp_path / "wheels").mkdir()
    monkeypatch.setattr(transport, "PART_BYTES", 200_000)  # several parts, as the real checkpoint needs
    packed = tmp_path / "packed"
    transport.main(["pack", "--artifacts", str(tiny_embed_artifact), "--site-packages", str(site_packages),
                    "--wheels", str(tmp_path / "wheels"), "--out", str(packed)])
    checkpoint = Path(json.loads((tiny_embed_artifact / "manifest.json").read_text())["model"]["path"])
    assert len(list(packed.glob("part*"))) >= 2
    assert not list(packed.rglob("*.safetensors"))  # weights travel only as checkpoint parts + recipes

    unpacked = tmp_path / "gpu"
    transport.main(["unpack", str(packed), "--site", str(unpacked / "site"), "--artifacts-dir",
                    str(unpacked / "artifacts"), "--model-dir", str(unpacked / "model")])
    rebuilt = unpacked / "artifacts" / tiny_embed_artifact.name
    originals = sorted(p.relative_to(tiny_embed_artifact) for p in tiny_embed_artifact.rglob("*") if p.is_file())
    assert sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file()) == originals
    for relative in originals:
        assert file_sha256(rebuilt / relative) == file_sha256(tiny_embed_artifact / relative), relative
    assert file_sha256(unpacked / "model" / "model.safetensors") == file_sha256(checkpoint / "model.safetensors")
    assert [p.name for p in (unpacked / "site" / "tvm" / "lib").iterdir()] == ["libtvm_runtime.so"]
    assert load_artifact(rebuilt).refused == {}


def test_unpack_refuses_a_missing_part(transport, tiny_embed_artifact, tmp_path, monkeypatch):
    (tmp_path / "site-packages" / "tvm").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    monkeypatch.setattr(transport, "PART_BYTES", 200_000)
    packed = tmp_path / "packed"
    transport.main(["pack", "--artifacts", str(tiny_embed_artifact), "--site-packages", str(tmp_path / "site-packages"),
                    "--wheels", str(tmp_path / "wheels"), "--out", str(packed)])
    shutil.rmtree(packed / "part0")
    with pytest.raises(SystemExit, match="checkpoint parts are missing or damaged"):
        transport.main(["unpack", str(packed), "--site", str(tmp_path / "site"), "--artifacts-dir",
                        str(tmp_path / "artifacts"), "--model-dir", str(tmp_path / "model")])
