"""Starting a server on loopback as a subprocess, waiting for /ready, sampling its memory.

Used by the load tests and by the test suite's `serve` fixture: one way to run a real server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MemorySampler(threading.Thread):
    """Peak resident memory (RSS) of a process and its children, sampled every 100 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_bytes = 0
        self._stop = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            process = psutil.Process(self.pid)
            while not self._stop.is_set():
                procs = [process, *process.children(recursive=True)]
                self.peak_bytes = max(self.peak_bytes, sum(p.memory_info().rss for p in procs))
                self._stop.wait(0.1)
        except psutil.Error:
            pass

    def stop(self) -> None:
        self._stop.set()


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log: Path
    memory: MemorySampler


@contextlib.contextmanager
def running_server(artifacts: list[Path], *args: str, log_path: Path, env: dict[str, str] | None = None,
                   ready_headers: dict[str, str] | None = None, timeout: float = 600.0) -> Iterator[RunningServer]:
    """`python -m service --artifacts ... *args` on 127.0.0.1:<free port>, yielded once /ready is 200;
    terminated (SIGTERM, then SIGKILL after 30 s) on exit."""
    port = free_port()
    command = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
    for directory in artifacts:
        command += ["--artifacts", str(directory)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                   env={**os.environ, **(env or {})})
    memory = MemorySampler(process.pid)
    memory.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", headers=ready_headers, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield RunningServer(url, process, log_path, memory)
    finally:
        memory.stop()
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
