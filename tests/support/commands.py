"""The repository's commands as tests run them: each in a subprocess, from the repository's root (or, for
bert-compile's refusals, its `main` in this process)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_ONLY = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}  # TVM's runtime library alone, as without its compiler


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m compile --quiet ARGS`."""
    return subprocess.run([sys.executable, "-m", "compile", "--quiet", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """`python -m compile --quiet ARGS` as `compile.cli.main` in this process: what the process would exit
    with and print, without paying a new interpreter's torch and TVM imports for each refusal."""
    from compile.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    sigterm = signal.getsignal(signal.SIGTERM)  # main installs its own handler
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), contextlib.chdir(REPO):
            code = main(["--quiet", *args])
    except SystemExit as exc:  # argparse's refusals exit from inside main
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return subprocess.CompletedProcess(["bert-compile", *args], code, stdout.getvalue(), stderr.getvalue())


def run_verify(*args: str) -> subprocess.CompletedProcess:
    """`python -m compile.verify ARGS` with TVM's runtime library alone."""
    return subprocess.run([sys.executable, "-m", "compile.verify", *args], env=RUNTIME_ONLY,
                          capture_output=True, text=True, timeout=300)
