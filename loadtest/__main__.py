"""`python -m loadtest`: the compiled server against the PyTorch-eager server, same traffic.

Starts each server on 127.0.0.1, waits for /ready, runs a closed-loop concurrency sweep and
open-loop arrival rates against /embed and /classify, and writes JSON, CSV, PNG plots and a
markdown report. Every level is bounded by a request count and a time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
from collections import Counter
from pathlib import Path

from artifact.errors import ArtifactError

from .driver import closed_loop, open_loop
from .machine import describe as describe_machine
from .report import saturation_verdict, summarize, write_outputs
from .servers import LOGS, SUMMED_METRICS, compute_path_counts, padding_share, running_server
from .workload import artifact_tokenizer, make_requests

PROG = "python -m loadtest"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts/minilm-cpu"))
    parser.add_argument("--backends", default="tvm,torch")
    parser.add_argument("--endpoints", default="/embed,/classify")
    parser.add_argument("--concurrency", default="1,4,16,64", help="closed-loop levels")
    parser.add_argument("--rates", default="4,16", help="open-loop arrival rates (requests/s)")
    parser.add_argument("--requests", type=int, default=300, help="requests per level (upper bound)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level (upper bound)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small levels; finishes in under two minutes")
    parser.add_argument("--out", type=Path, default=Path("docs/loadtest"))
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument for both servers")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.rates, args.requests, args.time_limit = "1,8", "8", 24, 15.0
    return args


def token_counter(artifacts: Path):
    tokenizer = artifact_tokenizer(artifacts)
    return lambda texts: sum(len(encoding.ids) for encoding in tokenizer.encode_batch(texts))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    try:
        count_tokens = token_counter(args.artifacts)
    except ArtifactError as exc:  # before any server starts
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    requests = make_requests(args.requests, seed=args.seed)
    tokens = [count_tokens(r.inputs) for r in requests]
    backends = args.backends.split(",")
    endpoints = args.endpoints.split(",")
    levels = [("closed", int(c)) for c in args.concurrency.split(",")] + [("open", float(r)) for r in args.rates.split(",")]
    rows = []
    total = len(backends) * len(endpoints) * len(levels)
    step = 0
    for backend in backends:
        log(f"loadtest: starting {backend} server ...")
        with running_server([args.artifacts], "--backend", backend, *args.server_arg,
                            log_path=LOGS / f"loadtest-server-{backend}.log") as server:
            base, memory = server.url, server.memory
            for endpoint in endpoints:
                for mode, level in levels:
                    step += 1
                    before = compute_path_counts(base)
                    if mode == "closed":
                        run = closed_loop(base, endpoint, requests, tokens, level, args.time_limit)
                    else:
                        run = open_loop(base, endpoint, requests, tokens, level, args.time_limit, seed=args.seed)
                    outcomes, elapsed = asyncio.run(run)
                    counts = compute_path_counts(base)
                    batches = Counter({k: v for k, v in (counts - before).items() if k not in SUMMED_METRICS.values()})
                    row = {"backend": backend, "endpoint": endpoint, "mode": mode, "level": level,
                           **summarize(outcomes, elapsed), "batches_by_path": dict(batches),
                           "padding_share": padding_share(before, counts),
                           "peak_rss_mb": memory.peak_bytes / 2**20}
                    total_batches = sum(batches.values())
                    row["bucket_share"] = (sum(v for k, v in batches.items() if k.startswith("bucket")) / total_batches
                                           if total_batches else None)
                    rows.append(row)
                    log(f"loadtest [{step}/{total}] {backend} {endpoint} {mode} {level}: {row['answered']}/{row['sent']} "
                        f"answered, {row['throughput_rps']:.1f} req/s, p99 {row['latency_ms']['p99'] or 0:.0f} ms, "
                        f"errors {row['errors'] or 'none'}")
    from importlib.metadata import version

    report = {
        "command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**describe_machine(), "platform": platform.platform()},
        "versions": {name: version(name) for name in ("apache-tvm", "torch", "transformers", "fastapi", "uvicorn")},
        "artifacts": str(args.artifacts),
        "rows": rows,
        "verdicts": [v for e in endpoints if "tvm" in backends and "torch" in backends
                     for v in [saturation_verdict(rows, "torch", "tvm", e)] if v],
    }
    write_outputs(report, args.out)
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
