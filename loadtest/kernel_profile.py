"""`python -m loadtest.kernel_profile --artifacts DIR --shape BxS`: where one call's time goes, kernel by
kernel, in the library that serves that shape (or the generic one with `--generic`).

A Relax VM instrument times every packed function the call runs; kernels are grouped by name
without their numeric suffix (the six `fused_attention` of six layers are one row). The
instrument's own cost is in the per-kernel times, so the table ends with the same call timed
without it. Full rows of random token ids, as `loadtest.bench` times `1xS`."""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

from artifact.bucketing import PackedBucket
from artifact.cores import limit_pool_spinning, usable_cores
from artifact.errors import ArtifactError
from compile.bucketing import parse_bucket
from compile.errors import CompileError

from .strategy_table import read_manifest

PROG = "python -m loadtest.kernel_profile"


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--shape", default="1x128", help="batch x sequence length (default 1x128)")
    parser.add_argument("--generic", action="store_true", help="profile the generic library, not the bucket")
    parser.add_argument("--calls", type=_at_least_one, default=20, help="calls timed (default 20)")
    parser.add_argument("--threads", type=_at_least_one, default=usable_cores(),
                        help="TVM threads (default: the cores this process may use)")
    return parser.parse_args(argv)


def profile(model, ids, mask, generic: bool, calls: int) -> tuple[list[tuple[str, int, float]], float, float, str]:
    """(kernel, calls per model call, ms per model call) by time, the instrumented and the plain
    median ms of a call, and the library that ran it."""
    run = model.run_generic if generic else model.run
    for _ in range(3):
        result = run(ids, mask)
    runner = model.generic if result.bucket is None else model.runners[result.bucket]  # the planner's choice
    seconds, counts, started = collections.defaultdict(float), collections.Counter(), {}

    def instrument(_func, name, before_run, _ret, *_args):
        if before_run:
            started[name] = time.perf_counter()
        else:
            kernel = re.sub(r"\d+$", "", name)
            seconds[kernel] += time.perf_counter() - started[name]
            counts[kernel] += 1
        return 0  # go on as usual

    def timed(times: list[float]) -> None:
        start = time.perf_counter()
        run(ids, mask)
        times.append(time.perf_counter() - start)

    instrumented, plain = [], []
    runner.set_instrument(instrument)
    try:
        for _ in range(calls):
            timed(instrumented)
    finally:
        runner.set_instrument(None)
    for _ in range(calls):
        timed(plain)
    rows = sorted(((k, counts[k] // calls, seconds[k] / calls * 1e3) for k in seconds), key=lambda row: -row[2])
    return rows, statistics.median(instrumented) * 1e3, statistics.median(plain) * 1e3, result.path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape = parse_bucket(args.shape)
        if isinstance(shape, PackedBucket):
            raise CompileError(f"--shape {args.shape}: expected BATCHxSEQ (e.g. 1x128)")
        read_manifest(args.artifacts)
    except (ArtifactError, CompileError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's thread pool starts
    limit_pool_spinning()
    import numpy as np

    from artifact.loader import load_artifact

    try:
        model = load_artifact(args.artifacts)
    except ArtifactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    vocab = model.manifest.model.vocab_size
    ids = np.random.default_rng(0).integers(min(1000, vocab - 1), vocab, (shape.batch, shape.seq))
    try:
        rows, instrumented, plain, served = profile(model, ids, np.ones_like(ids), args.generic, args.calls)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    total = sum(ms for _, _, ms in rows)
    print(f"{args.artifacts.name}, {args.shape} on {served}, {args.threads} threads, {args.calls} calls\n")
    print("| kernel | calls | ms per call | share |\n|---|---|---|---|")
    for kernel, count, ms in rows:
        print(f"| {kernel} | {count} | {ms:.3f} | {ms / total:.1%} |")
    print(f"\nsum of kernels {total:.2f} ms; call median {instrumented:.2f} ms instrumented, {plain:.2f} ms without")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
