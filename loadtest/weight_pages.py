"""`python -m loadtest.weight_pages --artifacts DIR`: what the loader's huge pages for the weights
(`artifact.loader.on_huge_pages`) are worth, per shape.

The library that serves each shape is called with the weights as the loader holds them and with a
copy of them on the allocator's ordinary pages, the two taking turns call by call (the order
alternating), so the ratio of their medians is out of the machine's drift. Full rows of random
token ids, as `loadtest.bench` times `1xS`. It prints how much of the process the kernel backs
with huge pages: where that is 0 (transparent huge pages `never`), both sides run on 4 KB pages."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from artifact.bucketing import PackedBucket
from artifact.cores import limit_pool_spinning, usable_cores
from artifact.errors import ArtifactError
from compile.bucketing import parse_bucket
from compile.errors import CompileError

from .machine import describe, line

PROG = "python -m loadtest.weight_pages"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--shapes", default="1x16,1x128,1x512",
                        help="batch x sequence lengths (default 1x16,1x128,1x512)")
    parser.add_argument("--calls", type=int, default=60, help="calls timed on each side, per shape (default 60)")
    return parser.parse_args(argv)


def huge_pages_kb() -> int:
    """This process's memory on transparent huge pages, in kB (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/smaps_rollup") as rollup:
            return next((int(row.split()[1]) for row in rollup if row.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def paired_medians_ms(call, weights: dict[str, list], calls: int) -> dict[str, float]:
    """Median ms of `call(weights[side])` for each side, the sides taking turns, the order alternating."""
    times = {side: [] for side in weights}
    sides = list(weights)
    for turn in range(calls):
        for side in sides if turn % 2 == 0 else sides[::-1]:
            started = time.perf_counter()
            call(weights[side])
            times[side].append(time.perf_counter() - started)
    return {side: statistics.median(samples) * 1e3 for side, samples in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shapes = [parse_bucket(text) for text in args.shapes.split(",")]
        if any(isinstance(shape, PackedBucket) for shape in shapes) or args.calls < 1:
            raise CompileError(f"--shapes {args.shapes}: expected BATCHxSEQ,... (e.g. 1x16,1x128) and --calls >= 1")
    except CompileError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("TVM_NUM_THREADS", str(usable_cores()))  # before TVM's thread pool starts
    limit_pool_spinning()
    import numpy as np
    import tvm

    from artifact.loader import load_artifact

    try:
        model = load_artifact(args.artifacts)
    except ArtifactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.artifacts.name}: {huge_pages_kb() // 1024} MB of this process on huge pages\n")
    print("| shape | weights on huge pages ms | on 4 KB pages ms | huge / 4 KB |\n|---|---|---|---|")
    vocab = model.manifest.model.vocab_size
    for shape in shapes:
        ids = np.random.default_rng(0).integers(min(1000, vocab - 1), vocab, (shape.batch, shape.seq))
        mask = np.ones_like(ids)
        bucket = model.select(shape.batch, shape.seq)
        runner = model.generic if bucket is None else model.runners[bucket]
        inputs = model.library_inputs(bucket, ids, mask)[0]
        loaded = runner.weights
        ordinary = [tvm.runtime.tensor(weight.numpy()) for weight in loaded]

        def call(weights: list) -> None:
            runner.weights = weights
            runner(*inputs)

        medians = paired_medians_ms(call, {"huge": loaded, "ordinary": ordinary}, args.calls)
        runner.weights = loaded
        print(f"| {shape.name} | {medians['huge']:.3f} | {medians['ordinary']:.3f} | "
              f"{medians['huge'] / medians['ordinary']:.3f} |")
    print(f"\nCPU: {line(describe())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
