"""Turning queued inputs into batches that cost little: pure functions, no I/O.

A batch's cost is what running it will take: the measured latency of the library that would run
it (each bucket's median, recorded at compile time; the generic library by the cost model fitted
over shapes), so that fixed per-call overhead, small-batch inefficiency and quadratic attention
all count. Artifacts without measurements fall back to padded tokens (batch x seq of the bucket,
as TEI counts the budget of padded backends). A packed artifact's libraries compute only the real
tokens: a batch costs its library's cost model at its token count, attention padded to the
library's sequence bound (`PackedCosts`).

Inputs are sorted by token count, then cut into the batches of least total cost. Among the
buckets that hold a batch, the cheapest runs it; inputs longer than every bucket go to the
generic library, at their own shape, in batches of their own. (Letting the generic library
compete with padded buckets by its fitted cost model was measured and halved throughput on mixed
traffic: the fit is too coarse to beat a bucket's own measurement, see docs/PERFORMANCE.md.) No batch overflows the token or
request budget or needs a bigger batch than any bucket has (an oversized batch is split into
bucket-sized ones, never sent to the generic path wholesale).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from artifact.bucketing import AnyBucket, Bucket, PackedBucket

# Without measurements, a call's fixed cost (dispatch, per-op launches, copies) in tokens' worth of
# compute: MiniLM's 1x16 bucket takes ~5 ms where 1x128 takes ~18.5, about 30 tokens of overhead.
CALL_TOKENS = 32


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_requests: int | None
    generic_max_batch: int


@dataclass(frozen=True)
class Choice:
    bucket: AnyBucket | None  # None: the generic library at the batch's own shape
    cost: float
    computed_tokens: int


# (batch, seq, tokens) -> ms: a library's latency for `batch` sequences padded to `seq` for
# attention, `tokens` rows through the linear layers (`CostModel.predicted_ms`)
LatencyModel = Callable[[int, int, int], float]


class BatchCosts:
    """What a batch of `size` inputs padded to `seq` tokens costs on each library that can run it."""

    def __init__(self, buckets: Sequence[Bucket], bucket_ms: dict[Bucket, float] | None = None,
                 generic_ms: Callable[[int, int], float] | None = None):
        self.buckets = sorted(buckets)
        measured = bucket_ms is not None and generic_ms is not None and all(b in bucket_ms for b in self.buckets)
        self.measured = measured
        self._bucket_cost = (lambda b: bucket_ms[b]) if measured else (lambda b: float(CALL_TOKENS + b.capacity))
        self._generic_cost = generic_ms if measured else (lambda size, seq: float(CALL_TOKENS + size * seq))
        self._chosen: dict[tuple[int, int], Choice | None] = {}  # the planner asks for the same shapes often

    def choose(self, size: int, seq: int, tokens: int | None = None) -> Choice | None:
        """The cheapest bucket that holds the batch, or None when none does."""
        key = (size, seq)
        if key not in self._chosen:
            fitting = [bucket for bucket in self.buckets if bucket.fits(size, seq)]
            best = min(fitting, key=lambda bucket: (self._bucket_cost(bucket), bucket), default=None)
            self._chosen[key] = None if best is None else Choice(best, self._bucket_cost(best), best.capacity)
        return self._chosen[key]

    def generic(self, size: int, seq: int, tokens: int | None = None) -> Choice:
        return Choice(None, self._generic_cost(size, seq), size * seq)


class PackedCosts:
    """What a batch costs on a packed artifact: its real tokens through the linear layers, its
    sequences padded to the library's bound for attention. Without measurements: tokens, plus
    the call overhead, plus attention's padded tokens (to prefer the tightest bound)."""

    def __init__(self, buckets: Sequence[PackedBucket], bucket_models: dict[PackedBucket, LatencyModel] | None = None,
                 generic_model: LatencyModel | None = None):
        self.buckets = sorted(buckets)
        self.measured = (bucket_models is not None and generic_model is not None
                         and all(b in bucket_models for b in self.buckets))
        unmeasured = lambda size, seq, tokens: float(CALL_TOKENS + tokens + size * seq)  # noqa: E731
        self._bucket_models = bucket_models if self.measured else {b: unmeasured for b in self.buckets}
        self._generic_model = generic_model if self.measured else unmeasured

    def choose(self, size: int, seq: int, tokens: int | None = None) -> Choice | None:
        """The tightest bound that holds the batch: the same tokens, the least attention padding
        (the libraries' fits differ by noise, not by kernels, so they do not pick here)."""
        tokens = size * seq if tokens is None else tokens
        best = next((bucket for bucket in self.buckets if bucket.fits(size, seq)), None)
        return None if best is None else Choice(best, self._bucket_models[best](size, best.seq, tokens), tokens)

    def generic(self, size: int, seq: int, tokens: int | None = None) -> Choice:
        tokens = size * seq if tokens is None else tokens
        return Choice(None, self._generic_model(size, seq, tokens), tokens)


Costs = BatchCosts | PackedCosts


def unmeasured_costs(buckets: Sequence[AnyBucket]) -> Costs:
    """Costs in tokens, for a backend whose libraries were not timed."""
    if any(isinstance(bucket, PackedBucket) for bucket in buckets):
        return PackedCosts(buckets)
    return BatchCosts(buckets)


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
    (a packed library takes any number), within the request limit."""
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
    most = batch_size_hint(costs.buckets, limits)
    return max(len(batch.indices) for batch in plan_batches([length] * most, costs, limits))


def batch_size_hint(buckets: Sequence[AnyBucket], limits: BatchLimits) -> int:
    """How many inputs make a full batch: used to size the sort window and to stop waiting."""
    padded = [bucket.batch for bucket in buckets if isinstance(bucket, Bucket)]
    largest = max(padded) if padded else limits.generic_max_batch
    return min(largest, limits.max_batch_requests or largest)
