"""Turning queued inputs into batches that cost little: pure functions, no I/O.

What a batch costs on each library, and so which library runs it, is `artifact.costs` (the
libraries' latencies measured at compile time, or padded tokens without them): the loader asks
the same function when a benchmark runs a batch, so it times the library the server runs.

Inputs are sorted by token count, then cut into the batches of least total cost. Among the
buckets that hold a batch, the cheapest runs it; inputs longer than every bucket go to the
generic library, at their own shape, in batches of their own. (Letting the generic library
compete with padded buckets by its fitted cost model was measured and halved throughput on mixed
traffic: the fit is too coarse to beat a bucket's own measurement, docs/experiments/padded-grid.md.)
No batch overflows the token or request budget or needs a bigger batch than any bucket has (an
oversized batch is split into bucket-sized ones, never sent to the generic path wholesale).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from artifact.bucketing import AnyBucket, Bucket
from artifact.costs import Choice, Costs


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_requests: int | None
    generic_max_batch: int


@dataclass(frozen=True)
class PlannedBatch:
    indices: list[int]
    bucket: AnyBucket | None
    cost_ms: float | None = None  # the library's measured latency for it; None when unmeasured


def wide_run_pays(queued: int, arrival_rate: float, cost_ms: float | None) -> bool:
    """Whether a batch should take every core: nothing else is queued and, at the recent arrival
    rate, no request is expected while it runs (an arrival during a wide run waits for all of it,
    so under load batches run side by side on one core each). Unmeasured costs keep lone batches
    wide."""
    if queued:
        return False
    return cost_ms is None or arrival_rate * cost_ms / 1e3 < 1.0


def most_inputs(buckets: Sequence[AnyBucket], limits: BatchLimits) -> int:
    """The most inputs one batch may hold: the largest padded bucket's rows or the generic bound
    (a packed library takes any number), within the request limit. The batcher sorts a few such
    batches' worth of inputs at a time."""
    largest = max([bucket.batch for bucket in buckets if isinstance(bucket, Bucket)] + [limits.generic_max_batch])
    return min(largest, limits.max_batch_requests or largest)


def plan_batches(lengths: Sequence[int], costs: Costs, limits: BatchLimits) -> list[PlannedBatch]:
    """Indices into `lengths`, grouped into the batches of least total cost, shortest inputs first.

    The inputs are sorted by length and cut into consecutive groups by dynamic programming over
    the cut points (a greedy cut cannot see that 8 inputs on an 8-row bucket cost less than 8
    single runs when 2 on it cost more than 2 single runs). Ties go to fewer batches.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lengths = [lengths[i] for i in order]
    prefix = [0]
    for length in sorted_lengths:
        prefix.append(prefix[-1] + length)
    largest = most_inputs(costs.buckets, limits)
    fits_bucket = [costs.choose(1, length, length) is not None for length in sorted_lengths]
    n = len(order)
    best: list[tuple[float, int]] = [(0.0, 0)] + [(float("inf"), 0)] * n  # (cost, batches) of the first j inputs
    cut: list[tuple[int, Choice | None]] = [(0, None)] * (n + 1)
    for end in range(1, n + 1):
        seq = sorted_lengths[end - 1]  # the longest of any group ending here
        for start in range(end - 1, max(0, end - largest) - 1, -1):
            size, tokens = end - start, prefix[end] - prefix[start]
            if fits_bucket[end - 1]:
                choice = costs.choose(size, seq, tokens)
            elif fits_bucket[start] or size > limits.generic_max_batch:
                break  # generic batches hold only what no bucket holds; growing further cannot help
            else:
                choice = costs.generic(size, seq, tokens)
            if choice is None:
                break  # no bucket holds this many: neither does one for more
            if size > 1 and choice.computed_tokens > limits.max_batch_tokens:
                break
            total = (best[start][0] + choice.cost, best[start][1] + 1)
            if total < best[end]:
                best[end], cut[end] = total, (start, choice)
    batches: list[PlannedBatch] = []
    end = n
    while end > 0:
        start, choice = cut[end]
        batches.append(PlannedBatch(order[start:end], choice.bucket, choice.cost if costs.measured else None))
        end = start
    return batches[::-1]


def shared_limits(limits: BatchLimits, queued: int, workers: int) -> BatchLimits:
    """`limits`, with no batch holding more than its share of the `queued` inputs when `workers`
    run batches side by side: the plan cheapest in total (everything in one call, the per-call
    cost paid once) would leave the other workers idle."""
    if workers < 2 or queued < 2:
        return limits
    share = -(-queued // workers)
    return replace(limits, max_batch_requests=min(limits.max_batch_requests or share, share))


def full_batch_size(length: int, costs: Costs, limits: BatchLimits) -> int:
    """How many inputs of `length` tokens the planner puts in one batch when it has plenty: a
    batch this full gains nothing from waiting for company (with measured costs, two 2-row calls
    may beat one 4-row call, and then two inputs are a full batch)."""
    most = most_inputs(costs.buckets, limits)
    return max(len(batch.indices) for batch in plan_batches([length] * most, costs, limits))
