"""How many cores the server may use, and how its inference workers share them.

A process may use the CPUs of its affinity mask, further capped by a container's CFS quota
(cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), as Go's automaxprocs and the JVM count them. The
workers never ask for more threads than that: W narrow workers of T intra-op threads each
(W x T <= cores) run independent batches side by side under load, and, when the server is
otherwise idle, a lone batch runs on a *wide* worker that uses every core (TVM keeps one thread
pool per calling thread, so each worker's pool is sized once, on its own thread). The wide
worker and the narrow ones never run at once (see `service.lanes`), so the cores are never
oversubscribed. docs/PERFORMANCE.md has the measurements behind the default.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class TopologyError(ValueError):
    """Flags that would oversubscribe the cores the process may use."""


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The container's CPU quota in cores (e.g. 1.5), or None when there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1; -1: no quota
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may keep busy: its affinity mask, capped by the cgroup quota (floored, >= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return max(1, cores)


@dataclass(frozen=True)
class Topology:
    cores: int  # what the process may use
    workers: int  # batches that run side by side under load
    threads_per_worker: int  # intra-op threads of each of those
    wide: bool  # a lone batch on an idle server runs on every core

    def describe(self) -> dict:
        return asdict(self)


def plan_topology(cores: int, backend: str, workers: int | None = None, threads_per_worker: int | None = None,
                  wide: bool | None = None) -> Topology:
    """The default, or the flags' choice checked against the cores.

    TVM: one single-threaded worker per core (independent batches scale perfectly, while a
    2-thread batch of a small bucket gains little) plus the wide worker for latency when idle.
    PyTorch: one worker over every core (its OpenMP threads are shared process-wide, so a wide
    worker beside narrow ones is not possible), which is also what a PyTorch server runs.
    """
    if backend == "torch":
        workers = workers or max(1, cores // (threads_per_worker or cores))
        threads_per_worker = threads_per_worker or max(1, cores // workers)
        wide = False if wide is None else wide
        if wide:
            raise TopologyError("--wide-worker needs --backend tvm (PyTorch's thread count is process-wide)")
    else:
        threads_per_worker = threads_per_worker or max(1, cores // (workers or cores))
        workers = workers or max(1, cores // threads_per_worker)
        wide = (cores > threads_per_worker) if wide is None else wide
    if workers * threads_per_worker > cores:
        raise TopologyError(
            f"{workers} workers x {threads_per_worker} threads would oversubscribe the {cores} cores this process "
            f"may use (affinity and cgroup quota); lower --workers or --threads-per-worker"
        )
    return Topology(cores, workers, threads_per_worker, wide and cores > threads_per_worker)
