"""How many cores a process running an artifact may keep busy: its CPU affinity, capped by a
container's CFS quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), as Go's automaxprocs and the
JVM count them. The compile stage times libraries with that many threads; the server sizes its
workers from it; and how long their idle thread-pool workers spin."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")

# sched_yield calls (~0.5 us each on the 2-core EPYC of docs/PERFORMANCE.md) an idle TVM pool worker
# makes before it sleeps: ~1 ms bridges the gaps between one call's kernels, so they do not wait
# for a sleeping worker, and the pool is asleep ~1 ms after the call. TVM's default, 300000
# (~150 ms), kept a core busy in a server answering one query every 50 ms (tests/test_service_minilm.py).
POOL_SPIN_YIELDS = 2000


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


def limit_pool_spinning() -> None:
    """Give TVM's thread pools `POOL_SPIN_YIELDS` (unless the environment sets its own); call before
    the first pool exists."""
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(POOL_SPIN_YIELDS))
