"""Writing an artifact directory atomically (staged in a sibling temp dir, renamed at the end)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from artifact.levels import is_multi_level
from artifact.manifest import MANIFEST_FILE

from .errors import CompileError


def _check_destination(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CompileError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file() and not is_multi_level(out):
        raise CompileError(f"--out {out} is a non-empty directory that is not an artifact; refusing to replace it")


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a staging directory that becomes `out` only if the block succeeds.

    A failure or interrupt (KeyboardInterrupt, SystemExit from SIGTERM) removes the staging
    directory and leaves `out` exactly as it was: nothing new, nothing half-written.
    """
    out = Path(out).absolute()
    _check_destination(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    except OSError as exc:
        raise CompileError(f"--out {out} is not writable: {exc.strerror or exc}") from None
    try:
        yield staging
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(retired / out.name)
            staging.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
