"""What a batch costs on each library of an artifact, and so which library runs it.

The one place that chooses a library for a batch: the service's planner (`service.planning`)
and the loader (`CompiledModel.run` without a bucket, as the benchmarks call it) both ask
`choose`, so a benchmark times the library the server runs.

A batch's cost is what running it will take: the measured latency of the library that would run
it (each bucket's median, recorded at compile time; the generic library by the cost model fitted
over shapes), so that fixed per-call overhead, small-batch inefficiency and quadratic attention
all count. Artifacts without measurements fall back to padded tokens (batch x seq of the bucket,
as TEI counts the budget of padded backends). A packed artifact's libraries compute only the real
tokens: a batch costs its library's cost model at its token count, attention padded to the
library's sequence bound (`PackedCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .bucketing import AnyBucket, Bucket, PackedBucket
from .manifest import Manifest

# Without measurements, a call's fixed cost (dispatch, per-op launches, copies) in tokens' worth of
# compute: MiniLM's 1x16 bucket takes ~5 ms where 1x128 takes ~18.5, about 30 tokens of overhead.
CALL_TOKENS = 32


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

    def bucket_for(self, size: int, seq: int) -> Bucket | None:
        """`choose`'s bucket (its cost does not depend on the real tokens)."""
        choice = self.choose(size, seq)
        return None if choice is None else choice.bucket

    def generic(self, size: int, seq: int, tokens: int | None = None) -> Choice:
        return Choice(None, self._generic_cost(size, seq), size * seq)


# How much cheaper the generic library's model must predict a packed batch than its tightest bound's
# for the batch to run there, in an artifact whose bounds compute a score bias at the bound
# (`GenericEntry.takes_bounded_batches`: DeBERTa's disentangled terms; one 16-token input took 2.7x
# the generic time on a 128-token bound). Elsewhere a bound sizes only attention's scratch (the
# generic library ran 0.90-1.08x a bound's time on MiniLM: their fits differ by noise), and the
# tightest bound runs every batch it holds.
GENERIC_MARGIN = 1.5


class PackedCosts:
    """What a batch costs on a packed artifact: its real tokens through the linear layers, its
    sequences padded to the library's bound for attention. Without measurements: tokens, plus
    the call overhead, plus attention's padded tokens (to prefer the tightest bound)."""

    def __init__(self, buckets: Sequence[PackedBucket], bucket_models: dict[PackedBucket, LatencyModel] | None = None,
                 generic_model: LatencyModel | None = None, generic_max_batch: int = 0):
        self.buckets = sorted(buckets)
        self.measured = (bucket_models is not None and generic_model is not None
                         and all(b in bucket_models for b in self.buckets))
        unmeasured = lambda size, seq, tokens: float(CALL_TOKENS + tokens + size * seq)  # noqa: E731
        self._bucket_models = bucket_models if self.measured else {b: unmeasured for b in self.buckets}
        self._generic_model = generic_model if self.measured else unmeasured
        self.generic_max_batch = generic_max_batch  # 0: the generic library is never chosen over a bound
        self._chosen: dict[tuple[int, int], PackedBucket | None] = {}

    def choose(self, size: int, seq: int, tokens: int | None = None) -> Choice | None:
        """The tightest bound that holds the batch, or the generic library where its model predicts
        the batch GENERIC_MARGIN cheaper (`bucket_for` decides, by shape); None where no bound holds it."""
        tokens = size * seq if tokens is None else tokens
        bucket = self.bucket_for(size, seq)  # cached: the planner asks for the same shapes often
        if bucket is not None:
            return Choice(bucket, self._bucket_models[bucket](size, bucket.seq, tokens), tokens)
        if self._tightest(size, seq) is None:
            return None
        return Choice(None, self._generic_model(size, seq, tokens), tokens)

    def bucket_for(self, size: int, seq: int) -> PackedBucket | None:
        """`choose`'s bucket without its cost (None: the generic library), decided once per shape: what
        a caller that only runs the batch needs (a model's call of one sequence spent 35 us choosing,
        with the caches full of weights)."""
        key = (size, seq)
        if key not in self._chosen:
            tightest = self._tightest(size, seq)
            if tightest is not None and self.measured and size <= self.generic_max_batch:
                tokens = size * seq
                bound_ms = self._bucket_models[tightest](size, tightest.seq, tokens)
                if self._generic_model(size, seq, tokens) * GENERIC_MARGIN < bound_ms:
                    tightest = None
            self._chosen[key] = tightest
        return self._chosen[key]

    def _tightest(self, size: int, seq: int) -> PackedBucket | None:
        return next((bucket for bucket in self.buckets if bucket.fits(size, seq)), None)

    def generic(self, size: int, seq: int, tokens: int | None = None) -> Choice:
        tokens = size * seq if tokens is None else tokens
        return Choice(None, self._generic_model(size, seq, tokens), tokens)


Costs = BatchCosts | PackedCosts


def unmeasured_costs(buckets: Sequence[AnyBucket]) -> Costs:
    """Costs in tokens, for a backend whose libraries were not timed."""
    if any(isinstance(bucket, PackedBucket) for bucket in buckets):
        return PackedCosts(buckets)
    return BatchCosts(buckets)


def measured_costs(manifest: Manifest, buckets: list[AnyBucket]) -> Costs:
    """Batch costs on `buckets` (a loaded model's: refused ones left out) from the latencies the
    compile stage measured (padded tokens where it did not)."""
    model = manifest.generic.cost_model
    generic = model.predicted_ms if model is not None else None
    if manifest.layout == "packed":
        models = {entry.bucket: entry.cost_model.predicted_ms for entry in manifest.buckets
                  if entry.cost_model is not None}
        return PackedCosts(buckets, models, generic,
                           manifest.generic.max_batch if manifest.generic.takes_bounded_batches else 0)
    bucket_ms = {entry.bucket: entry.latency_ms for entry in manifest.buckets if entry.latency_ms is not None}
    return BatchCosts(buckets, bucket_ms, generic)
