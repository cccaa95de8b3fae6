"""The repository's commands as tests run them: each in a subprocess, from the repository's root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_ONLY = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}  # TVM's runtime library alone, as without its compiler


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m compile --quiet ARGS`."""
    return subprocess.run([sys.executable, "-m", "compile", "--quiet", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def run_verify(*args: str) -> subprocess.CompletedProcess:
    """`python -m compile.verify ARGS` with TVM's runtime library alone."""
    return subprocess.run([sys.executable, "-m", "compile.verify", *args], env=RUNTIME_ONLY,
                          capture_output=True, text=True, timeout=300)
