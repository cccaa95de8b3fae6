"""`python -m loadtest.memory`: a server's resident memory under mixed traffic, against its idle size.

Starts `python -m service` on the artifact, answers a few short queries (every lazy start-up done),
reads its idle RSS, then sends `--requests` mixed requests from `--clients` clients over every
embedding route (a few words to past the model's limit, 1 to 32 inputs: batches of nearly every
token count) while sampling RSS every 50 ms, and reads RSS once the load has stopped. Prints one
JSON line: idle, peak and settled RSS in MB and their ratios to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

from artifact.errors import ArtifactError

from .http_client import Connection
from .servers import LOGS, running_server
from .strategy_table import read_manifest
from .workload import make_requests

MB = 2**20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def mixed_bodies(count: int, seed: int = 0) -> list[tuple[str, dict]]:
    """(path, body) for every embedding route; one in seven holds long or many inputs."""
    rng = random.Random(seed)
    long_text = " ".join(rng.choice(["memory", "kernel", "search", "index", "river"]) for _ in range(400))
    bodies = []
    for request in make_requests(count, seed):
        texts, kind = request.inputs, rng.random()
        if kind < 0.35:
            bodies.append(("/embed", {"inputs": texts, "truncate": True}))
        elif kind < 0.5:  # OpenAI's route has no `truncate`: inputs within the limit, whatever the server's default
            bodies.append(("/v1/embeddings", {"input": [" ".join(text.split()[:100]) for text in texts]}))
        elif kind < 0.6:
            bodies.append(("/classify", {"inputs": texts[0], "labels": ["sports", "weather", "music"],
                                         "truncate": True}))
        elif kind < 0.7:
            bodies.append(("/similarity", {"inputs": {"source_sentence": texts[0], "sentences": texts},
                                           "truncate": True}))
        elif kind < 0.78:
            bodies.append(("/tokenize", {"inputs": texts}))
        elif kind < 0.85:
            bodies.append(("/", {"inputs": texts, "truncate": True}))
        elif kind < 0.95:
            bodies.append(("/embed", {"inputs": [long_text[: rng.randrange(40, 2000)]] * rng.choice([1, 4, 16]),
                                      "truncate": True}))
        else:
            bodies.append(("/embed", {"inputs": [" ".join(texts)] * 32, "truncate": True}))
    return bodies


async def send_all(url: str, bodies: list[tuple[str, dict]], clients: int) -> list[int]:
    """Every body sent once, by `clients` closed-loop clients; the HTTP statuses."""
    pending, statuses = iter(bodies), []

    async def client() -> None:
        connection = Connection(url)
        try:
            for path, body in pending:
                statuses.append((await connection.post(path, body, timeout=300)).status)
        finally:
            await connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return statuses


class PeakSampler(threading.Thread):
    """The highest RSS of `pid`, sampled every 50 ms while it runs."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def measure(url: str, pid: int, requests: int, clients: int, seed: int = 0) -> dict:
    """Idle, peak and settled RSS of the server at `url` (process `pid`) around the mixed load."""
    short_queries = [("/embed", {"inputs": f"query number {i}"}) for i in range(20)]
    warm = asyncio.run(send_all(url, short_queries, 1))
    time.sleep(0.5)
    idle = rss_bytes(pid)
    sampler = PeakSampler(pid)
    sampler.start()
    statuses = asyncio.run(send_all(url, mixed_bodies(requests, seed), clients))
    peak = max(sampler.stop(), rss_bytes(pid))
    time.sleep(0.5)
    settled = rss_bytes(pid)
    counts: dict[str, int] = {}
    for status in warm + statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return {"requests": len(statuses), "statuses": counts, "idle_mb": idle / MB, "peak_mb": peak / MB,
            "settled_mb": settled / MB, "peak_over_idle": peak / idle, "settled_over_idle": settled / idle}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts/minilm-cpu"))
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args, server_flags = parser.parse_known_args(argv)  # the rest go to the server (e.g. --max-batch-tokens)
    try:
        read_manifest(args.artifacts)  # before a server starts: one line where the directory holds no artifact
    except ArtifactError as exc:
        print(f"python -m loadtest.memory: error: {exc}", file=sys.stderr)
        return 2
    with running_server([args.artifacts], "--log-level", "warning", *server_flags,
                        log_path=LOGS / "memory-server.log") as server:
        result = measure(server.url, server.process.pid, args.requests, args.clients, args.seed)
    print(json.dumps({"artifacts": str(args.artifacts), "server_flags": server_flags, "clients": args.clients,
                      **{key: round(value, 3) if isinstance(value, float) else value
                         for key, value in result.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
