"""Interleaved timing: every backend runs once per round, in a rotating order, so machine noise
(other tenants, frequency changes) spreads over all of them instead of biasing one."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_medians(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Median, min and max seconds per candidate over `repeats` interleaved rounds."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - started)
    return {
        name: {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "runs": len(values)}
        for name, values in samples.items()
    }
