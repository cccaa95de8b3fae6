"""SHA-256 of files: how manifests pin libraries, weights and checkpoints. Standard library only,
so the GPU transport script can use it before any package is installed."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
