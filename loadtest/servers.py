"""Starting a server on loopback as a subprocess, waiting for /ready, sampling its memory."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx


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


@contextlib.contextmanager
def running_server(artifacts: list[Path], backend: str, log_path: Path, ready_timeout: float = 600.0,
                   extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[tuple[str, MemorySampler]]:
    """Start `python -m service` on 127.0.0.1:<free port>; yield its base URL once /ready says 200."""
    port = free_port()
    command = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), "--backend", backend]
    for directory in artifacts:
        command += ["--artifacts", str(directory)]
    command += list(extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        sampler = MemorySampler(process.pid)
        sampler.start()
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{backend} server exited with {process.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{backend} server not ready after {ready_timeout:.0f} s; see {log_path}")
                time.sleep(0.25)
            yield base, sampler
        finally:
            sampler.stop()
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
