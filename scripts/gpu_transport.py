"""Carry compiled CUDA artifacts, their checkpoint and TVM's runtime to the lent GPU machine.

That machine reaches no package index and takes at most 64 MiB per call, while one MiniLM
artifact set weighs ~270 MB, most of it the same numbers three times: the checkpoint, the
artifact's fp32 weights (the checkpoint's tensors, some transposed, Q/K/V concatenated) and its
fp16 weights (those cast). So `pack` ships the checkpoint once, split into parts of one call
each, and for every artifact weight file its safetensors header plus a recipe saying how each
tensor is made from checkpoint tensors (or the tensor itself, e.g. CPU weights packed in panels);
`unpack` rebuilds the files byte for byte and checks
every sha256 against the manifests. TVM goes as its runtime only (no 250 MB compiler library),
Python packages the GPU image lacks as wheels.

    python scripts/gpu_transport.py pack --artifacts artifacts/cuda-float32-graph ... --out .gpu
    python scripts/gpu_transport.py unpack .gpu --site /tmp/site      # on the GPU machine
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile.hashing import file_sha256 as sha256  # noqa: E402  (standard library only)

PART_BYTES = 56 * 2**20  # one call's share, leaving room for the repository itself
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_header(path: Path) -> tuple[bytes, dict]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        raw = handle.read(length)
    return struct.pack("<Q", length) + raw, json.loads(raw)


def tensors_in_file_order(header: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])


def recipe_for(target: np.ndarray, sources: dict[str, np.ndarray]) -> list[list]:
    """[[source, transposed], ...] whose pieces, concatenated along the one axis where they
    differ from `target`, give `target` (cast to its dtype); a single piece for a copy.
    Raises ValueError when there is none (the tensor then travels as it is)."""
    wanted = np.asarray(target, dtype=np.float32)
    views = [(name, transposed, array.T if transposed else array)
             for name, array in sources.items() for transposed in ((False, True) if array.ndim == 2 else (False,))]
    for name, transposed, view in views:
        if view.shape == wanted.shape and np.array_equal(view.astype(target.dtype), target):
            return [[name, transposed]]
    for axis in range(wanted.ndim):
        pieces, offset = [], 0
        while offset < wanted.shape[axis]:
            for name, transposed, view in views:
                if view.ndim != wanted.ndim or offset + view.shape[axis] > wanted.shape[axis]:
                    continue
                if all(view.shape[d] == wanted.shape[d] for d in range(wanted.ndim) if d != axis):
                    size = view.shape[axis]
                    part = np.take(target, range(offset, offset + size), axis=axis)
                    if np.array_equal(view.astype(target.dtype), part):
                        pieces.append([name, transposed])
                        offset += size
                        break
            else:
                break
        if offset == wanted.shape[axis]:
            return pieces + [["axis", axis]]
    raise ValueError(f"no recipe for a tensor of shape {target.shape}")


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def pack(artifacts: list[Path], site_packages: Path, wheels: Path, out: Path) -> None:
    from safetensors.numpy import load_file

    manifests = [json.loads((a / "manifest.json").read_text()) for a in artifacts]
    model_dirs = {m["model"]["path"] for m in manifests}
    if len(model_dirs) != 1:
        raise SystemExit(f"artifacts come from different checkpoints: {sorted(model_dirs)}")
    model_dir = Path(model_dirs.pop())
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    rest = out / "rest"
    rest.mkdir(parents=True)
    weights_file = model_dir / "model.safetensors"
    data = weights_file.read_bytes()
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for index, part in enumerate(parts):
        directory = out / f"part{index}" if index < len(parts) - 1 else rest
        directory.mkdir(exist_ok=True)
        (directory / f"model.safetensors.{index:02d}").write_bytes(part)
    index = {"model_dir": str(model_dir), "model_sha256": sha256(weights_file), "artifacts": {}}
    with tarfile.open(rest / "bundle.tar.xz", "w:xz") as tar:
        for path in sorted(model_dir.rglob("*")):
            if path.is_file() and path.name != "model.safetensors":
                tar.add(path, f"model/{path.relative_to(model_dir)}")
        for artifact, manifest in zip(artifacts, manifests):
            recipes = {}
            for entry in manifest["weights"].values():
                header_bytes, header = read_header(artifact / entry["file"])
                tensors = load_file(str(artifact / entry["file"]))
                steps = []
                for name, meta in tensors_in_file_order(header):
                    try:
                        steps.append([name, meta["dtype"], recipe_for(tensors[name], checkpoint)])
                    except ValueError:  # e.g. CPU weights packed into panels: carried as they are
                        raw = f"raw/{artifact.name}/{len(steps)}-{entry['file']}.npy"
                        _add_bytes(tar, raw, _npy_bytes(tensors[name]))
                        steps.append([name, meta["dtype"], [["raw", raw]]])
                recipes[entry["file"]] = {"header": header_bytes.hex(), "tensors": steps}
            index["artifacts"][artifact.name] = recipes
            for path in sorted(artifact.rglob("*")):
                if path.is_file() and not path.name.endswith(".safetensors"):
                    tar.add(path, f"artifacts/{artifact.name}/{path.relative_to(artifact)}")
        tar.add(site_packages / "tvm", "site/tvm",
                filter=lambda info: None if info.name.endswith("libtvm_compiler.so") or "/3rdparty" in info.name
                or "/src/" in info.name or "__pycache__" in info.name else info)
        for wheel in sorted(wheels.glob("*.whl")):
            tar.add(wheel, f"wheels/{wheel.name}")
    (rest / "index.json").write_text(json.dumps(index))
    for directory in sorted(out.iterdir()):
        size = sum(p.stat().st_size for p in directory.rglob("*"))
        print(f"{directory}: {size / 2**20:.1f} MiB (one device call each; rest goes last)")


def unpack(packed: Path, site: Path, artifacts_dir: Path, model_dir: Path | None = None) -> None:
    """Rebuild what `pack` carried; the checkpoint goes where the manifests say it is, unless
    `model_dir` says otherwise (the manifests' paths then no longer lead to it)."""
    from safetensors.numpy import load_file

    rest = packed / "rest"
    index = json.loads((rest / "index.json").read_text())
    model_dir = model_dir or Path(index["model_dir"])
    chunks = sorted(packed.glob("*/model.safetensors.*"), key=lambda p: p.name)
    with tarfile.open(rest / "bundle.tar.xz") as tar:
        tar.extractall(packed / "unpacked", filter="data")
    unpacked = packed / "unpacked"
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(unpacked / "model", model_dir)
    with open(model_dir / "model.safetensors", "wb") as handle:
        for chunk in chunks:
            handle.write(chunk.read_bytes())
    if sha256(model_dir / "model.safetensors") != index["model_sha256"]:
        raise SystemExit(f"checkpoint parts are missing or damaged ({len(chunks)} found)")
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    for name, recipes in index["artifacts"].items():
        artifact = artifacts_dir / name
        shutil.rmtree(artifact, ignore_errors=True)
        shutil.copytree(unpacked / "artifacts" / name, artifact)
        manifest = json.loads((artifact / "manifest.json").read_text())
        expected = {entry["file"]: entry["sha256"] for entry in manifest["weights"].values()}
        for file, recipe in recipes.items():
            with open(artifact / file, "wb") as handle:
                handle.write(bytes.fromhex(recipe["header"]))
                for _, dtype, steps in recipe["tensors"]:
                    *sources, last = steps
                    if last[0] == "raw":
                        array = np.load(unpacked / last[1])
                    elif last[0] == "axis":
                        views = [checkpoint[s].T if t else checkpoint[s] for s, t in sources]
                        array = np.concatenate(views, axis=last[1])
                    else:
                        source, transposed = last
                        array = checkpoint[source].T if transposed else checkpoint[source]
                    handle.write(np.ascontiguousarray(array.astype(SAFETENSORS_DTYPES[dtype])).tobytes())
            if sha256(artifact / file) != expected[file]:
                raise SystemExit(f"{artifact / file} did not rebuild byte for byte")
        print(f"{artifact}: weights rebuilt, sha256 as in the manifest")
    site.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(site / "tvm", ignore_errors=True)
    shutil.copytree(unpacked / "site" / "tvm", site / "tvm")
    wheels = sorted((unpacked / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), "--upgrade", *map(str, wheels)], check=True)
    print(f"{site}: TVM runtime + {len(wheels)} wheels; checkpoint at {model_dir}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack")
    packer.add_argument("--artifacts", type=Path, action="append", required=True)
    packer.add_argument("--site-packages", type=Path, default=Path(".venv/lib/python3.11/site-packages"))
    packer.add_argument("--wheels", type=Path, default=Path(".gpu-wheels"),
                        help="cp312 wheels of the Python packages the GPU image lacks")
    packer.add_argument("--out", type=Path, default=Path(".gpu"))
    unpacker = commands.add_parser("unpack")
    unpacker.add_argument("packed", type=Path)
    unpacker.add_argument("--site", type=Path, default=Path("/tmp/site"))
    unpacker.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    unpacker.add_argument("--model-dir", type=Path, help="where to put the checkpoint (default: where it was)")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.artifacts, args.site_packages, args.wheels, args.out)
    else:
        unpack(args.packed, args.site, args.artifacts_dir, args.model_dir)


if __name__ == "__main__":
    main()
