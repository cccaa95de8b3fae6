"""`python -m loadtest.kernel_profile --artifacts DIR --shape BxS`: where one call's time goes, kernel by
kernel, in the library that serves that shape (or the generic one with `--generic`).

A Relax VM instrument times every packed function the call runs; kernels are grouped by name
without their numeric suffix (the six `fused_attention` of six layers are one row). The
instrument's own cost is in the per-kernel times, so the table ends with the same call timed
without it. Full rows of random token ids, as `loadtest.bench` times `1xS`.

`--compare DIR` profiles a second artifact in the same process, the two taking turns call by call
(the order alternating), and adds each kernel's time there and the median over those pairs of
its time over the first's: a kernel's change between two builds, out of the machine's drift.

`--openvino default|f32` takes OpenVINO into the turns, on the ONNX export of the artifact's
checkpoint (as `loadtest.bench` runs it), timed by its own per-node counters, and ends with a
table of where each one's time goes by part of the layer (linears, attention, the rest) and
which of OpenVINO's kernels ran them: under `ONEDNN_MAX_CPU_ISA` it says which of its linears
that setting held (brgemm_avx2) and which ran on MLAS, which picks its kernels from `cpuid`."""

from __future__ import annotations

import argparse
import collections
import functools
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

from .arguments import at_least_one
from .machine import describe, line
from .strategy_table import read_manifest

PROG = "python -m loadtest.kernel_profile"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="a second artifact, profiled in turn with the first")
    parser.add_argument("--shape", default="1x128", help="batch x sequence length (default 1x128)")
    parser.add_argument("--generic", action="store_true", help="profile the generic library, not the bucket")
    parser.add_argument("--calls", type=at_least_one, default=20, help="calls timed (default 20)")
    parser.add_argument("--threads", type=at_least_one, default=usable_cores(),
                        help="TVM threads (default: the cores this process may use)")
    parser.add_argument("--openvino", choices=("default", "f32"),
                        help="also profile OpenVINO at its default precision on this CPU, or f32")
    return parser.parse_args(argv)


PARTS = ("linears", "attention", "the rest")


def part_of(kernel: str) -> str:
    """The part of a BERT layer one of our kernels computes, by its name (an attention left unfused,
    at a head size its kernel does not take, counts its two batch matmuls among the linears)."""
    return "attention" if "attention" in kernel else "linears" if "matmul" in kernel else "the rest"


class KernelTimer:
    """One model's calls at one shape, timed kernel by kernel (a Relax VM instrument on the library
    the planner chose for the shape) or whole."""

    def __init__(self, model, ids, mask, generic: bool):
        self._call = functools.partial(model.run_generic if generic else model.run, ids, mask)
        for _ in range(3):
            result = self._call()
        self._runner = model.generic if result.bucket is None else model.runners[result.bucket]
        inputs, _ = model.library_inputs(result.bucket, ids, mask)
        self._library_call = functools.partial(self._runner, *inputs)  # the call without choosing or packing
        self.served = result.path
        self.kernels: dict[str, list[float]] = collections.defaultdict(list)  # seconds per call, call by call
        self.counts: dict[str, int] = {}  # launches per call
        self.instrumented: list[float] = []
        self.plain: list[float] = []
        self.library: list[float] = []  # the library's call alone, right after each plain one

    def instrumented_call(self) -> None:
        seconds, counts, started = collections.defaultdict(float), collections.Counter(), {}

        def instrument(_func, name, before_run, _ret, *_args):
            if before_run:
                started[name] = time.perf_counter()
            else:
                kernel = re.sub(r"\d+$", "", name)
                seconds[kernel] += time.perf_counter() - started[name]
                counts[kernel] += 1
            return 0  # go on as usual

        self._runner.set_instrument(instrument)
        try:
            self.instrumented.append(self._timed(self._call))
        finally:
            self._runner.set_instrument(None)
        for kernel, spent in seconds.items():
            self.kernels[kernel].append(spent)
        self.counts.update(counts)

    def plain_call(self) -> None:
        self.plain.append(self._timed(self._call))
        self.library.append(self._timed(self._library_call))

    def outside_library_ms(self) -> float:
        """The median of a plain call's time less its library call's: choosing the library, checking
        and packing the inputs (each right after a call, when the caches hold weights)."""
        return statistics.median(p - q for p, q in zip(self.plain, self.library)) * 1e3

    @staticmethod
    def _timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    def by_time(self) -> list[tuple[str, int, float]]:
        """(kernel, launches per call, mean ms per call), the slowest first."""
        return _by_time(self.kernels, self.counts)

    def parts(self) -> dict[str, list[tuple[str, int, float]]]:
        """`by_time`'s rows by the part of the layer each kernel computes."""
        rows = collections.defaultdict(list)
        for row in self.by_time():
            rows[part_of(row[0])].append(row)
        return rows


def _by_time(kernels: dict, counts: dict) -> list[tuple[object, int, float]]:
    rows = ((kernel, counts[kernel], statistics.fmean(spent) * 1e3) for kernel, spent in kernels.items())
    return sorted(rows, key=lambda row: -row[2])


class OpenVinoTimer:
    """OpenVINO's calls at the same shape, timed node by node by its own counters (a model compiled
    with them) or whole (one compiled without); its nodes grouped by part and the kernel they ran."""

    def __init__(self, plain, profiled, source, feed: dict):
        self._plain, self._profiled, self._feed = plain, profiled, feed
        self._parts = profiled.parts(source)
        self.precision = plain.precision()
        for _ in range(3):
            plain(feed)
            profiled(feed)
        self.isa = profiled.isa()  # once a call has chosen the kernels of a dynamic shape
        self.kernels: dict[tuple[str, str], list[float]] = collections.defaultdict(list)  # (part, kernel)
        self.counts: dict[tuple[str, str], int] = {}
        self.instrumented: list[float] = []
        self.plain: list[float] = []

    def instrumented_call(self) -> None:
        start = time.perf_counter()
        self._profiled(self._feed)
        self.instrumented.append(time.perf_counter() - start)
        seconds, counts = collections.defaultdict(float), collections.Counter()
        for node, kernel, spent in self._profiled.node_times():
            seconds[self._parts.get(node, "the rest"), kernel] += spent
            counts[self._parts.get(node, "the rest"), kernel] += 1
        for key, spent in seconds.items():
            self.kernels[key].append(spent)
        self.counts.update(counts)

    def plain_call(self) -> None:
        start = time.perf_counter()
        self._plain(self._feed)
        self.plain.append(time.perf_counter() - start)

    def parts(self) -> dict[str, list[tuple[str, int, float]]]:
        """(kernel, nodes per call, mean ms per call) by part, the slowest first."""
        rows = collections.defaultdict(list)
        for (part, kernel), count, ms in _by_time(self.kernels, self.counts):
            rows[part].append((kernel, count, ms))
        return rows


def profile(timers: list, calls: int) -> None:
    """`calls` instrumented calls of each timer, then as many plain ones, the timers taking turns
    and the order of each turn alternating, so that all see the same drift of the machine."""
    for step in ("instrumented_call", "plain_call"):
        for turn in range(calls):
            for timer in (timers if turn % 2 == 0 else timers[::-1]):
                getattr(timer, step)()


def paired_ratio(after: list[float], before: list[float]) -> float:
    """The median over the turns of one time over the other's in the same turn."""
    return statistics.median(a / b for a, b in zip(after, before))


def print_profile(name: str, shape: str, threads: int, calls: int, timer: KernelTimer) -> None:
    rows = timer.by_time()
    total = sum(ms for _, _, ms in rows)
    print(f"{name}, {shape} on {timer.served}, {threads} threads, {calls} calls\n")
    print("| kernel | calls | ms per call | share |\n|---|---|---|---|")
    for kernel, count, ms in rows:
        print(f"| {kernel} | {count} | {ms:.3f} | {ms / total:.1%} |")
    print(f"\nsum of kernels {total:.2f} ms; call median {statistics.median(timer.instrumented) * 1e3:.2f} ms "
          f"instrumented, {statistics.median(timer.plain) * 1e3:.2f} ms without, of which "
          f"{timer.outside_library_ms():.3f} ms outside the library's call "
          f"(choosing it, checking and packing the inputs)")


def print_comparison(names: tuple[str, str], shape: str, threads: int, calls: int,
                     timers: tuple[KernelTimer, KernelTimer]) -> None:
    first, second = timers
    print(f"{names[0]} against {names[1]}, {shape} on {first.served} and {second.served}, {threads} threads, "
          f"{calls} calls each, taking turns\n")
    print(f"| kernel | calls | {names[0]} ms per call | {names[1]} ms per call | {names[1]} / {names[0]}, "
          f"median of turns |\n|---|---|---|---|---|")
    second_ms = {kernel: ms for kernel, _, ms in second.by_time()}
    for kernel, count, ms in first.by_time():
        if kernel in second_ms:
            ratio = paired_ratio(second.kernels[kernel], first.kernels[kernel])
            print(f"| {kernel} | {count} | {ms:.3f} | {second_ms[kernel]:.3f} | {ratio:.3f} |")
        else:
            print(f"| {kernel} | {count} | {ms:.3f} | - | - |")
    for kernel, count, ms in second.by_time():
        if kernel not in first.kernels:
            print(f"| {kernel} | {count} | - | {ms:.3f} | - |")
    print(f"\ncall median without the instrument: {statistics.median(first.plain) * 1e3:.2f} ms and "
          f"{statistics.median(second.plain) * 1e3:.2f} ms, {names[1]} / {names[0]} "
          f"{paired_ratio(second.plain, first.plain):.3f} (median of turns); outside the library's call "
          f"{first.outside_library_ms():.3f} ms and {second.outside_library_ms():.3f} ms")


def print_parts(names: list[str], timers: list, peer: OpenVinoTimer) -> None:
    """Each model's time by part of the layer (kernels or nodes per call in brackets), OpenVINO's split
    by the kernels that ran it, and the plain calls' paired ratio to the first model."""
    label = f"OpenVINO {peer.precision}"
    print(f"\nby part of the layer: ms per call (kernels per call), {label}'s by the kernels it ran "
          f"({', '.join(peer.isa)})\n")
    print(f"| part | {' | '.join(names)} | {label} | {label}'s kernels |\n|---|{'---|' * (len(names) + 2)}")
    parts = [timer.parts() for timer in timers + [peer]]  # OpenVINO's last
    for part in PARTS:
        cells = [f"{sum(ms for *_, ms in rows):.3f} ({sum(count for _, count, _ in rows)})"
                 for rows in (model_parts[part] for model_parts in parts)]
        kernels = ", ".join(f"{kernel} {ms:.3f} ({count})" for kernel, count, ms in parts[-1][part]) or "-"
        print(f"| {part} | {' | '.join(cells)} | {kernels} |")
    medians = ", ".join(f"{statistics.median(timer.plain) * 1e3:.2f} ms" for timer in timers + [peer])
    ratios = ", ".join(f"{name} / {label} {paired_ratio(timer.plain, peer.plain):.3f}"
                       for name, timer in zip(names, timers))
    print(f"\ncall median without counters or instrument: {medians}; {ratios} (median of turns)")


def openvino_timer(args, model, ids) -> OpenVinoTimer:
    """OpenVINO on the ONNX export of `model`'s checkpoint (in a scratch directory), fed `ids`."""
    import tempfile

    import numpy as np

    from compile.checkpoint import INPUT_NAMES, load_wrapper

    from .onnx_peer import artifact_checkpoint, export_onnx
    from .openvino_peer import profiled_openvino

    manifest = model.manifest
    if manifest.target.kind == "cuda":
        raise ArtifactError("--openvino: OpenVINO is a CPU peer, and this is a CUDA artifact")
    wrapper = load_wrapper(artifact_checkpoint(manifest), manifest.task, manifest.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        plain, profiled, source = profiled_openvino(export_onnx(wrapper, Path(scratch) / "model.onnx"),
                                                    args.threads, args.openvino == "f32")
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    inputs = (ids, np.ones_like(ids), np.zeros_like(ids), positions)
    feed = {name: np.ascontiguousarray(x, dtype=np.int64) for name, x in zip(INPUT_NAMES, inputs)}
    return OpenVinoTimer(plain, profiled, source, feed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directories = [args.artifacts] + ([args.compare] if args.compare else [])
    try:
        shape = parse_bucket(args.shape)
        if isinstance(shape, PackedBucket):
            raise CompileError(f"--shape {args.shape}: expected BATCHxSEQ (e.g. 1x128)")
        for directory in directories:
            read_manifest(directory)
    except (ArtifactError, CompileError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's thread pool starts
    limit_pool_spinning()
    import numpy as np

    from artifact.loader import load_artifact

    try:
        models = [load_artifact(directory) for directory in directories]
        vocab = min(model.manifest.model.vocab_size for model in models)
        ids = np.random.default_rng(0).integers(min(1000, vocab - 1), vocab, (shape.batch, shape.seq))
        timers = [KernelTimer(model, ids, np.ones_like(ids), args.generic) for model in models]
        peer = openvino_timer(args, models[0], ids) if args.openvino else None
        profile(timers + ([peer] if peer else []), args.calls)
    except (ArtifactError, CompileError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    names = tuple(directory.name for directory in directories)
    if args.compare:
        print_comparison(names, args.shape, args.threads, args.calls, tuple(timers))
    else:
        print_profile(names[0], args.shape, args.threads, args.calls, timers[0])
    if peer:
        print_parts(list(names), timers, peer)
    print(f"CPU: {line(describe())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
