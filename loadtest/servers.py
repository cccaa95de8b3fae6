"""Starting a server on loopback, waiting for /ready, reading its peak memory.

`running_server` starts `python -m service` as a subprocess (the load tests and the test suite's
`serve` fixture); `running_app` runs an app built in this process under a real uvicorn on a
thread (tests and the soak, which hand it a fault-injecting backend loader).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "build" / "logs"  # the benchmarks' server logs (git-ignored)


_HANDED_OUT: set[int] = set()  # every port free_port gave this process
_PORTS = random.SystemRandom()  # not the `random` module's state, which a test may seed
FIRST_FREE_PORT = 10000  # free_port's candidates start here: above the well-known and common service ports


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (a bind to port 0, an outgoing connection)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range, that this process was not
    given before. The probe is closed before the caller binds: below that range no other process's
    port-0 bind or outgoing connection can take the port in between (Ray's services, started between
    the probe and Ray's HTTP proxy, once did), and two calls in a row (a server's HTTP and gRPC ports)
    never get the same one."""
    floor = ephemeral_floor()
    first = min(FIRST_FREE_PORT, floor // 2)
    while True:
        port = _PORTS.randrange(first, floor)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        _HANDED_OUT.add(port)
        return port


class PeakMemory:
    """Peak resident memory (RSS) of a process and its children: the kernel's high-water mark
    (`VmHWM` in /proc/PID/status) of each, summed, read when asked. A thread polling RSS instead
    took ~1.4 ms of CPU per sample (psutil walks every process to find children), ten times a
    second per server, on the cores the servers it measured were timed on."""

    def __init__(self, pid: int):
        self.pid = pid

    @property
    def peak_bytes(self) -> int:
        import psutil

        try:
            process = psutil.Process(self.pid)
            return sum(_high_water_mark(p) for p in [process, *process.children(recursive=True)])
        except psutil.Error:  # the server itself is gone
            return 0


def _high_water_mark(process) -> int:
    """VmHWM in bytes (Linux), else the current RSS; 0 for a child that has exited meanwhile."""
    import psutil

    try:
        with open(f"/proc/{process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return process.memory_info().rss
    except psutil.Error:
        return 0


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log: Path
    memory: PeakMemory
    ready_s: float  # from spawning the process to /ready answering 200 (polled every 0.1 s)


@contextlib.contextmanager
def running_server(artifacts: list[Path], *args: str, log_path: Path, env: dict[str, str] | None = None,
                   ready_headers: dict[str, str] | None = None, timeout: float = 600.0,
                   module: str = "service", python: str = sys.executable) -> Iterator[RunningServer]:
    """`python -m service --artifacts ... *args` (or another module taking the same --host, --port
    and --artifacts) on 127.0.0.1:<free port>, run by `python` (e.g. a serving-only environment's),
    yielded once /ready is 200; terminated (SIGTERM, then SIGKILL after 30 s) on exit."""
    port = free_port()
    command = [python, "-m", module, "--host", "127.0.0.1", "--port", str(port)]
    for directory in artifacts:
        command += ["--artifacts", str(directory)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                   env={**os.environ, **(env or {})})
    spawned = time.monotonic()
    previous_handler = _exit_on_sigterm()
    memory = PeakMemory(process.pid)
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
            time.sleep(0.1)
        yield RunningServer(url, process, log_path, memory, time.monotonic() - spawned)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def _exit_on_sigterm():
    """Make SIGTERM raise SystemExit in the main thread, so a benchmark stopped by it still stops
    the servers it started (Python's default SIGTERM ends the process without running `finally`).
    Returns the handler to restore, or None where nothing was changed."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


@contextlib.contextmanager
def running_app(app, **options) -> Iterator[str]:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a thread (`options`: more uvicorn settings);
    yields the base URL once it listens."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None,
                                           access_log=False, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def wait_until(condition, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `condition()` until it is true (a state to reach, not a time to wait); TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout:.0f} s")
        time.sleep(0.02)


def metric_samples(base: str) -> list:
    """Every sample of the server's Prometheus metrics (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_value(base: str, name: str, **labels: str) -> float:
    """One sample of the server's Prometheus metrics (0 when absent)."""
    for sample in metric_samples(base):
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return 0.0


# Metrics `compute_path_counts` sums besides the batches per path, and the keys it gives them.
SUMMED_METRICS = {"bert_serve_tokens_total": "tokens", "bert_serve_padding_tokens_total": "padding",
                  "bert_serve_inference_duration_seconds_sum": "inference_s"}


def compute_path_counts(base: str) -> Counter:
    """Batches per compute path so far, real and padding tokens computed (keys `tokens`, `padding`)
    and seconds spent running batches (`inference_s`), summed over the server's models, from its
    Prometheus metrics."""
    counts: Counter = Counter()
    for sample in metric_samples(base):
        if sample.name == "bert_serve_batches_total":
            counts[sample.labels["path"]] += sample.value
        elif sample.name in SUMMED_METRICS:
            counts[SUMMED_METRICS[sample.name]] += sample.value
    return counts


def padding_share(before: Counter, after: Counter) -> float | None:
    """Padding's share of the tokens computed between two `compute_path_counts`."""
    tokens, padding = (after[key] - before[key] for key in ("tokens", "padding"))
    return padding / (tokens + padding) if tokens + padding else None
