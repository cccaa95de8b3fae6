"""Interleaved timing: every backend runs once per round, in an order shuffled each round, so
machine noise (other tenants, frequency changes) spreads over all of them instead of biasing one,
and no backend always follows the same one (a runtime whose workers still spin after its call
slows whichever runs next: in a rotating order that is always the same candidate)."""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from typing import Callable

import numpy as np

from artifact.cores import limit_pool_spinning, usable_cores


def interleaved_medians(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, warm_calls: int = 0
) -> dict[str, dict[str, float]]:
    """Median, min and max seconds per candidate over `repeats` interleaved rounds. With `warm_calls`,
    each timed call follows that many untimed calls of the same candidate, so it finds its weights
    in the caches as a server does between requests (and not the previous candidate's)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)  # seeded: the same orders in every run
    for _round in range(repeats):
        for name in order.sample(names, len(names)):
            for _ in range(warm_calls):
                candidates[name]()
            started = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - started)
    return {
        name: {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "runs": len(values)}
        for name, values in samples.items()
    }


# Cores' worth of CPU that others may take while libraries are timed before the compile stage
# warns that its latencies (and the cost models fitted to them) are inflated.
OTHER_LOAD_WARNING_CORES = 0.25


class OtherLoad:
    """The CPU time other processes took during a `with` block, in cores (`cores`, set on exit):
    the machine's busy time (/proc/stat) less this process's own, its threads and waited-for
    children included. Stays 0 where /proc/stat cannot be read."""

    cores = 0.0

    def __enter__(self) -> "OtherLoad":
        self._started = (time.monotonic(), _machine_busy_s(), _own_busy_s())
        return self

    def __exit__(self, *_exc) -> None:
        started, machine, own = self._started
        now = _machine_busy_s()
        elapsed = time.monotonic() - started
        if machine is not None and now is not None and elapsed > 0:
            self.cores = max(0.0, (now - machine) - (_own_busy_s() - own)) / elapsed


def _machine_busy_s() -> float | None:
    """Seconds every CPU has spent busy since boot: all but idle and iowait, steal included (time
    the hypervisor gave other guests slows the timings as much); guest time is already inside
    user time, so the guest columns are left out."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def use_all_cores() -> int:
    """Size the calling thread's TVM thread pool to `TVM_NUM_THREADS`, else to every core of the
    process, and return that count. Without it TVM's pool takes half the cores on x86 (it
    assumes hyper-threading), so timings would not be those of a server that sets its threads."""
    import tvm

    # A thread's pool is created with TVM_NUM_THREADS workers (default: half the cores) and can
    # only use fewer later, so the variable must be set before the first pool exists.
    threads = int(os.environ.setdefault("TVM_NUM_THREADS", str(usable_cores())))
    limit_pool_spinning()  # as the server's pools spin
    tvm.get_global_func("runtime.config_threadpool")(1, threads)  # 1: kBig, every core on x86
    return threads


def budgeted_medians_ms(candidates: dict[str, Callable[[], object]], repeats: int = 5,
                        budget_s: float = 2.5) -> dict[str, float]:
    """Median ms per candidate: one warm-up round, then up to `repeats` interleaved rounds, fewer
    (at least one) when a round is slow enough that they would take more than `budget_s`."""
    started = time.perf_counter()
    for candidate in candidates.values():
        candidate()
    round_s = time.perf_counter() - started
    rounds = max(1, min(repeats, int(budget_s / max(round_s, 1e-9))))
    stats = interleaved_medians(candidates, repeats=rounds, warmup=0)
    return {name: value["median_s"] * 1e3 for name, value in stats.items()}


def fit_cost_model(samples: dict[tuple[int, ...], float]) -> tuple[float, float, float]:
    """(fixed, per_token, per_attention) >= 0 fitting ms = fixed + per_token * tokens +
    per_attention * b * s^2 to {(batch, seq): ms} (tokens = b * s) or {(batch, seq, tokens): ms},
    minimising the squared *relative* error (a 1x16 call matters to the planner as much as an
    8x128 one).

    Exact non-negative least squares for three terms: the best unconstrained fit over every subset
    of the terms whose coefficients are all non-negative (the optimum is one of them).
    """
    shapes = list(samples)
    measured = np.array([samples[shape] for shape in shapes], dtype=np.float64)
    if not len(shapes) or (measured <= 0).any():
        raise ValueError("need at least one positive timing to fit")
    columns = np.array([[1.0, shape[2] if len(shape) > 2 else shape[0] * shape[1], shape[0] * shape[1] ** 2]
                        for shape in shapes], dtype=np.float64)
    weighted, target = columns / measured[:, None], np.ones(len(shapes))
    best, best_residual = np.zeros(3), float(np.sum(target**2))
    for subset in itertools.product((False, True), repeat=3):
        used = np.flatnonzero(subset)
        if not len(used):
            continue
        solution, *_ = np.linalg.lstsq(weighted[:, used], target, rcond=None)
        if (solution < 0).any():
            continue
        coefficients = np.zeros(3)
        coefficients[used] = solution
        residual = float(np.sum((weighted @ coefficients - target) ** 2))
        if residual < best_residual - 1e-12 * max(best_residual, 1.0):
            best, best_residual = coefficients, residual
    return tuple(float(c) for c in best)
