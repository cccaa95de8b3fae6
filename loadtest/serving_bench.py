"""`python -m loadtest.serving_bench`: the server against its own libraries and the PyTorch server.

Starts one compiled server per worker topology and the PyTorch server(s), all on 127.0.0.1 at
once (an idle server's threads sleep), then measures, on this machine:

1. a single short query (1 input, ~8 tokens) over a kept-alive connection: each server's p50
   back to back (one server at a time) and after a pause (requests interleaved across servers,
   each after `--gap-ms` idle), against the in-process median of the library that serves it
   (every core, as the wide worker runs it), back to back and after the same pause; and the
   server process's CPU time per query after a pause (what a nearly idle server costs);
2. one request of 8 inputs x ~112 tokens: p50 per server, interleaved after pauses;
3. mixed traffic (the load-test workload) at a closed-loop concurrency: throughput and latency
   per server, one server at a time, in alternating order over `--rounds` rounds (medians).

Writes JSON and a markdown table; the table in docs/PERFORMANCE.md comes from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from artifact.cores import usable_cores

from .driver import closed_loop
from .machine import describe as describe_machine
from .machine import line as machine_line
from .report import summarize
from .servers import LOGS, compute_path_counts, padding_share, running_server
from .strategy_table import read_manifest
from .workload import VOCABULARY, artifact_tokenizer, make_requests

PROG = "python -m loadtest.serving_bench"

# name -> (backend, server flags); the first tvm entry is the default topology
TOPOLOGIES = {
    "tvm default (narrow x1 thread + wide)": ("tvm", []),
    "tvm narrow only (1 thread each)": ("tvm", ["--no-wide-worker"]),
    "tvm 1 worker x all cores": ("tvm", ["--workers", "1", "--threads-per-worker", "0"]),
    "tvm default, no batch queued ahead": ("tvm", ["--no-queue-ahead"]),
    "torch default (1 worker x all cores)": ("torch", []),
    "torch 1 thread per worker": ("torch", ["--threads-per-worker", "1", "--workers", "0"]),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts/minilm-cpu"))
    parser.add_argument("--short-requests", type=int, default=200, help="single-query requests per server")
    parser.add_argument("--long-requests", type=int, default=30, help="8 x 112-token requests per server")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop level of the mixed traffic")
    parser.add_argument("--mixed-requests", type=int, default=600, help="requests per mixed-traffic run")
    parser.add_argument("--rounds", type=int, default=2, help="mixed-traffic runs per server, alternating order")
    parser.add_argument("--compare", type=Path, action="append", default=[], metavar="ARTIFACTS",
                        help="another artifact of the same model, served with the default tvm topology; repeatable")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="idle time before each timed request")
    parser.add_argument("--only", help="comma-separated topology names to run (default: all)")
    parser.add_argument("--server-python", default=sys.executable,
                        help="the Python that runs the tvm-backend servers, e.g. .venv-serve/bin/python from "
                             "scripts/serve_env.sh (default: this one)")
    parser.add_argument("--out", type=Path, default=Path("docs/serving"))
    return parser.parse_args(argv)


def _text(words: int, seed: int) -> str:
    return " ".join(VOCABULARY[(seed * 7 + i * 13) % len(VOCABULARY)] for i in range(words))


def _resolve(flags: list[str], cores: int) -> list[str]:
    """'0' in a topology's flags means every core this machine has."""
    return [str(cores) if flag == "0" else flag for flag in flags]


def library_median_ms(artifacts: Path, ids: list[int], gap_s: float, repeats: int = 200) -> tuple[str, float, float]:
    """In-process medians of the library that serves one input of these ids, on every core: back
    to back, and `gap_s` after the previous call (an idle pool's wake-up, as the server sees it)."""
    import numpy as np

    from artifact.loader import load_artifact
    from compile.timing import interleaved_medians, use_all_cores

    use_all_cores()
    model = load_artifact(artifacts)
    input_ids = np.asarray([ids], dtype=np.int64)
    mask = np.ones_like(input_ids)
    path = model.run(input_ids, mask).path
    stats = interleaved_medians({"library": lambda: model.run(input_ids, mask)}, repeats, warmup=10)
    idle = []
    for _ in range(min(repeats, 100)):
        time.sleep(gap_s)
        started = time.perf_counter()
        model.run(input_ids, mask)
        idle.append(time.perf_counter() - started)
    return path, stats["library"]["median_s"] * 1e3, statistics.median(idle) * 1e3


class _Client:
    """A kept-alive connection from the stdlib's http.client: far lighter than httpx, so that the
    time measured is the server's and not the client's (both share this machine's cores)."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)

    def send(self, body: dict | None) -> tuple[int, dict[str, str]]:
        try:
            return self._send(body)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self.connection.close()  # the server closed the kept-alive connection (uvicorn: after 5 s idle)
            return self._send(body)

    def _send(self, body: dict | None) -> tuple[int, dict[str, str]]:
        if body is None:
            self.connection.request("GET", "/health")
        else:
            self.connection.request("POST", "/embed", json.dumps(body), {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        response.read()
        return response.status, {name.lower(): value for name, value in response.getheaders()}

    def close(self) -> None:
        self.connection.close()


BACK_TO_BACK_TURN = 20  # requests one server gets in a row before the next server's turn
SETTLE_S = 0.3  # before a turn: the previous server's pool threads (TVM, OpenMP) stop spinning well within it


def timed_requests(urls: dict[str, str], body: dict | None, count: int, gap_s: float,
                   interleave: bool) -> dict[str, dict]:
    """Send `body` to /embed `count` times per server over a kept-alive connection; p50 per server and
    the server's own timing parts. Without a body, GET /health instead: the HTTP round trip with no
    work behind it.

    `interleave`: servers take turns, each request `gap_s` after the last answer, so that no server's
    idle threads still spin (TVM's pool, OpenMP under torch) when another is timed: each request
    finds its server idle. Otherwise one server at a time, requests `gap_s` apart (0: back to back,
    as a busy client sees it), in turns of `BACK_TO_BACK_TURN` requests that go round the servers,
    so that a slow spell of the machine falls on every server alike; each turn starts `SETTLE_S`
    after the last one, with the other servers idle."""
    samples: dict[str, list[float]] = {name: [] for name in urls}
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    paths: dict[str, set] = {name: set() for name in urls}
    clients = {name: _Client(url) for name, url in urls.items()}
    try:
        names = list(urls)
        turns = -(-count // BACK_TO_BACK_TURN)
        order = ([names[i % len(names):] + names[: i % len(names)] for i in range(count)] if interleave
                 else [[name] * min(BACK_TO_BACK_TURN, count - turn * BACK_TO_BACK_TURN)
                       for turn in range(turns) for name in names])
        for turn in ([names] if interleave else []):  # connection set up and first-call costs out of the samples
            for name in turn:
                for _ in range(3):
                    clients[name].send(body)
        for turn in order:
            if not interleave:  # each turn starts once the last server's idle threads sleep, then warm
                time.sleep(SETTLE_S)
                for _ in range(3):
                    clients[turn[0]].send(body)
            for name in turn:
                time.sleep(gap_s)
                started = time.perf_counter()
                status, headers = clients[name].send(body)
                samples[name].append((time.perf_counter() - started) * 1e3)
                if status != 200:
                    raise RuntimeError(f"{name} answered {status}")
                paths[name].add(headers.get("x-compute-path"))
                parts[name].append(server_timing(headers.get("server-timing", "")))
    finally:
        for client in clients.values():
            client.close()
    return {name: {"p50_ms": statistics.median(values), "paths": sorted(p for p in paths[name] if p),
                   "server_p50_ms": {part: statistics.median(p[part] for p in parts[name]) for part in parts[name][0]}
                   if parts[name][0] else {}}
            for name, values in samples.items()}


def _cpu_s(server) -> float:
    """CPU seconds the server process has used so far (user + system, every thread)."""
    import psutil

    times = psutil.Process(server.process.pid).cpu_times()
    return times.user + times.system


def server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: tokenize;dur=0.041, ...` as {"tokenize": 0.041, ...} (ms)."""
    return {name: float(dur) for name, dur in (part.split(";dur=") for part in header.split(", ") if ";dur=" in part)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        for artifacts in [args.artifacts, *args.compare]:
            read_manifest(artifacts)
    except Exception as exc:  # noqa: BLE001 - one line, whatever is wrong with the directory
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    cores = usable_cores()
    chosen = args.only.split(",") if args.only else list(TOPOLOGIES)
    unknown = [name for name in chosen if name not in TOPOLOGIES]
    if unknown:
        print(f"{PROG}: error: unknown topology {unknown[0]!r}; choose from {list(TOPOLOGIES)}", file=sys.stderr)
        return 2
    tokenizer = artifact_tokenizer(args.artifacts)
    short = _text(6, 1)
    long_inputs = [_text(110, seed) for seed in range(8)]
    log(f"{PROG}: in-process library median for a {len(tokenizer.encode(short).ids)}-token query ...")
    served_by, library_ms, idle_library_ms = library_median_ms(args.artifacts, tokenizer.encode(short).ids,
                                                               args.gap_ms / 1e3)
    report = {"command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]), "machine": describe_machine(),
              "gap_ms": args.gap_ms,
              "artifacts": str(args.artifacts), "library": {"served_by": served_by, "median_ms": library_ms, "idle_median_ms": idle_library_ms},
              "short_tokens": len(tokenizer.encode(short).ids),
              "long_tokens": [len(tokenizer.encode(text).ids) for text in long_inputs]}
    requests = make_requests(args.mixed_requests, seed=0)
    tokens = [sum(len(e.ids) for e in tokenizer.encode_batch(r.inputs)) for r in requests]
    logs = LOGS / "serving_bench"
    plan = [(name, args.artifacts, *TOPOLOGIES[name]) for name in chosen]
    plan += [(f"tvm default, {path.name}", path, "tvm", []) for path in args.compare]
    with contextlib.ExitStack() as stack:
        servers = {}
        for index, (name, artifacts, backend, flags) in enumerate(plan):
            log(f"{PROG}: starting {name} ...")
            servers[name] = stack.enter_context(running_server(
                [artifacts], "--backend", backend, "--log-level", "warning", *_resolve(flags, cores),
                log_path=logs / f"server-{index}.log",
                python=args.server_python if backend == "tvm" else sys.executable))
        urls = {name: server.url for name, server in servers.items()}
        infos = {name: httpx.get(f"{url}/info").json() for name, url in urls.items()}
        report["topology"] = {name: info["topology"] for name, info in infos.items()}
        report["process"] = {name: {"ready_s": servers[name].ready_s, "rss_mb": info["memory"]["rss_bytes"] / 2**20,
                                    "weights_mb": info["memory"]["weights_bytes"] / 2**20}
                             for name, info in infos.items()}
        log(f"{PROG}: single short query x {args.short_requests} per server, back to back and after pauses ...")
        report["short"] = timed_requests(urls, {"inputs": short}, args.short_requests, 0.0, interleave=False)
        cpu_before = {name: _cpu_s(server) for name, server in servers.items()}
        report["short_after_pause"] = timed_requests(urls, {"inputs": short}, args.short_requests, args.gap_ms / 1e3,
                                                     interleave=True)
        for name, server in servers.items():  # what each query costs the machine, idle threads' spinning included
            report["short_after_pause"][name]["server_cpu_ms"] = (
                (_cpu_s(server) - cpu_before[name]) * 1e3 / args.short_requests)
        report["http_floor"] = timed_requests(urls, None, args.short_requests, 0.0, interleave=False)
        log(f"{PROG}: 8 x ~112 tokens x {args.long_requests} per server ...")
        report["long"] = timed_requests(urls, {"inputs": long_inputs, "truncate": True}, args.long_requests,
                                        args.gap_ms / 1e3, interleave=True)
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for round_index in range(args.rounds):
            order = list(urls) if round_index % 2 == 0 else list(urls)[::-1]
            for name in order:
                log(f"{PROG}: mixed traffic, concurrency {args.concurrency}, round {round_index + 1}: {name} ...")
                before, cpu_s = compute_path_counts(urls[name]), _cpu_s(servers[name])
                outcomes, elapsed = asyncio.run(closed_loop(urls[name], "/embed", requests, tokens,
                                                            args.concurrency, time_limit=120))
                after = compute_path_counts(urls[name])
                # how much of the machine the server used, and how much of that ran batches
                runs[name].append({**summarize(outcomes, elapsed), "padding_share": padding_share(before, after),
                                   "server_cores": (_cpu_s(servers[name]) - cpu_s) / elapsed,
                                   "batch_cores": (after["inference_s"] - before["inference_s"]) / elapsed})
        for name, server in servers.items():
            report["process"][name]["peak_rss_mb"] = server.memory.peak_bytes / 2**20
        report["mixed"] = {name: {"throughput_rps": statistics.median(r["throughput_rps"] for r in rs),
                                  "p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rs),
                                  "p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rs),
                                  "padding_share": statistics.median(r["padding_share"] or 0.0 for r in rs),
                                  "server_cores": statistics.median(r["server_cores"] for r in rs),
                                  "batch_cores": statistics.median(r["batch_cores"] for r in rs),
                                  "errors": [r["errors"] for r in rs]}
                           for name, rs in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "serving_bench.md").write_text(table + "\n")
    print(table)
    return 0


def markdown(report: dict) -> str:
    library = report["library"]
    lines = [f"CPU: {machine_line(report['machine'])}; library {library['served_by']} of {report['artifacts']} in process: {library['median_ms']:.2f} ms for a "
             f"{report['short_tokens']}-token query back to back, {library['idle_median_ms']:.2f} ms when each call "
             f"follows a {report['gap_ms']:g} ms pause.", "",
             "| server | topology (workers x threads, wide) | 1 short query p50 ms, back to back | after a pause "
             "| server CPU ms per query after a pause | 8 x ~112 tokens p50 ms | mixed traffic req/s | mixed p50 ms "
             "| mixed p99 ms | mixed padding share | mixed: server CPU, cores | mixed: batches running, workers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, mixed in report["mixed"].items():
        topology = report["topology"][name]
        shape = (f"{topology['workers']} x {topology['threads_per_worker']}{', wide' if topology['wide'] else ''}"
                 f"{'' if topology['queue_ahead'] else ', no queue-ahead'}")
        lines.append(f"| {name} | {shape} | {report['short'][name]['p50_ms']:.1f} | "
                     f"{report['short_after_pause'][name]['p50_ms']:.1f} | "
                     f"{report['short_after_pause'][name]['server_cpu_ms']:.1f} | "
                     f"{report['long'][name]['p50_ms']:.0f} | {mixed['throughput_rps']:.1f} | {mixed['p50_ms']:.0f} | "
                     f"{mixed['p99_ms']:.0f} | {100 * mixed['padding_share']:.0f}% | {mixed['server_cores']:.2f} | "
                     f"{mixed['batch_cores']:.2f} |")
    lines += ["", "| server | start to /ready s | RSS after warm-up MB | peak RSS MB | weight files MB |",
              "|---|---|---|---|---|"]
    for name, process in report["process"].items():
        lines.append(f"| {name} | {process['ready_s']:.1f} | {process['rss_mb']:.0f} | {process['peak_rss_mb']:.0f} | "
                     f"{process['weights_mb']:.0f} |")
    lines += ["", "Where the single query's time goes, back to back (medians, ms; the server's parts from its "
              "`Server-Timing` header):", "", "| server | client p50 | server total | tokenize | queue | inference "
              "| outside the server (HTTP, client) | GET /health p50 |", "|---|---|---|---|---|---|---|---|"]
    for name, short in report["short"].items():
        server = short.get("server_p50_ms") or {}
        if not server:
            continue
        lines.append(f"| {name} | {short['p50_ms']:.2f} | {server['total']:.2f} | {server['tokenize']:.2f} | "
                     f"{server['queue']:.2f} | {server['inference']:.2f} | {short['p50_ms'] - server['total']:.2f} | "
                     f"{report['http_floor'][name]['p50_ms']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
