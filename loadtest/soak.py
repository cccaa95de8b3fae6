"""`python -m loadtest.soak`: the load-test workload for a long time at saturation, with injected
backend failures, checking that the server stays whole.

The server is the real app (`service.app.create_app`) under uvicorn in its own process, its
backend wrapped by `loadtest.faults.FaultyBackend` so that `--fail-rate` of the batches raise.
The driver keeps `--concurrency` clients busy for `--duration` seconds, samples the server's
resident memory and admitted-input gauge every `--sample-every` seconds, and then checks:
every request got an HTTP answer (200, or the 500 of an injected failure: nothing else), the
admission count is back to zero, and memory is flat (the last fifth of the run's samples within
`--max-growth` of the second fifth's, after warm-up). Exit 0 when all hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from .driver import closed_loop
from .report import summarize
from .servers import LOGS, metric_value, running_server
from .strategy_table import read_manifest
from .workload import make_requests

PROG = "python -m loadtest.soak"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts/minilm-cpu"))
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (saturation)")
    parser.add_argument("--fail-rate", type=float, default=0.01, help="share of backend calls that raise")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth, late vs early")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/soak"))
    # the server side (started by the driver as `python -m loadtest.soak --serve ...`)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def serve(args) -> int:
    """The real app and uvicorn, with a fault-injecting backend."""
    from service import memory

    memory.configure_allocator()  # as bert-serve does, before any thread
    import uvicorn

    from service import logs
    from service.app import create_app
    from service.backends import load_backend
    from service.settings import Settings

    from .faults import FaultyBackend

    logs.configure("warning", "text")

    def loader(directory, kind, threads):
        return FaultyBackend(load_backend(directory, kind, threads), fail_rate=args.fail_rate, seed=args.seed)

    app = create_app(Settings(artifacts=[args.artifacts], host=args.host, port=args.port), loader=loader)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)
    return 0


class Sampler(threading.Thread):
    """RSS and admitted inputs of the server, every `every` seconds."""

    def __init__(self, url: str, pid: int, every: float):
        super().__init__(daemon=True)
        self.url, self.pid, self.every = url, pid, every
        self.samples: list[dict] = []
        self._done = threading.Event()

    def run(self) -> None:
        import psutil

        process = psutil.Process(self.pid)
        started = time.monotonic()
        while not self._done.wait(self.every):
            self.samples.append({"t_s": time.monotonic() - started, "rss_mb": process.memory_info().rss / 2**20,
                                 "admitted": metric_value(self.url, "bert_serve_admitted_inputs")})

    def stop(self) -> None:
        self._done.set()
        self.join()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    try:
        read_manifest(args.artifacts)
    except Exception as exc:  # noqa: BLE001 - one line, whatever is wrong with the directory
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    base = make_requests(2000, seed=args.seed)
    requests = base * (1 + int(args.duration * 200 / len(base)))  # more than can be sent in the time
    tokens = [0] * len(requests)
    log(f"{PROG}: starting the server with {args.fail_rate:.1%} injected failures ...")
    with running_server([args.artifacts], "--serve", "--fail-rate", str(args.fail_rate), "--seed", str(args.seed),
                        module="loadtest.soak", log_path=LOGS / "soak-server.log") as server:
        sampler = Sampler(server.url, server.process.pid, args.sample_every)
        sampler.start()
        log(f"{PROG}: {args.concurrency} clients for {args.duration:.0f} s ...")
        outcomes, elapsed = asyncio.run(closed_loop(server.url, "/embed", requests, tokens, args.concurrency,
                                                    args.duration, timeout=120))
        sampler.stop()
        admitted_after = metric_value(server.url, "bert_serve_admitted_inputs")
        failures = metric_value(server.url, "bert_serve_batch_failures_total")
        batches = sum(metric_value(server.url, "bert_serve_batches_total", path=path)
                      for path in {p for o in outcomes if o.compute_path for p in o.compute_path.split(",")})
        info = httpx.get(f"{server.url}/info").json()
    statuses = Counter("no answer" if o.status is None else o.status for o in outcomes)
    rss = [s["rss_mb"] for s in sampler.samples]
    fifth = max(1, len(rss) // 5)
    early, late = statistics.median(rss[fifth:2 * fifth] or rss), statistics.median(rss[-fifth:] or rss)
    checks = {
        "every request answered (200 or injected 500)": set(statuses) <= {200, 500},
        "admission back to zero": admitted_after == 0,
        f"memory flat (late <= early x {1 + args.max_growth:g})": late <= early * (1 + args.max_growth),
        "failures were injected": failures > 0,
    }
    report = {"command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
              "elapsed_s": elapsed, "summary": summarize(outcomes, elapsed), "statuses": dict(statuses),
              "failed_batches": failures, "batches": batches, "topology": info["topology"],
              "rss_mb": {"early_median": early, "late_median": late, "max": max(rss, default=None)},
              "admitted_after": admitted_after, "samples": sampler.samples, "checks": checks}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    for check, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'} {check}")
    print(f"{len(outcomes)} requests in {elapsed:.0f} s: {dict(statuses)}; failed batches {failures:.0f} of "
          f"{batches:.0f}; RSS {early:.0f} -> {late:.0f} MB; admitted after: {admitted_after:.0f}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
