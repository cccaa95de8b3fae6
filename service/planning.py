"""Turning queued inputs into batches that pad little: pure functions, no I/O.

Inputs are sorted by token count, then cut greedily into batches. A batch's cost is what it
will actually compute: the capacity (batch x seq) of the smallest bucket that holds it, as TEI
counts the budget for padded backends; inputs longer than every bucket go to the generic
library, at their own shape, in batches of their own. A batch is closed when the next input
would overflow the token or request budget, would need a bigger batch than any bucket has
(so an oversized batch is split into bucket-sized ones, never sent to the generic path
wholesale), or would grow the padded cost by more than running that input on its own costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from compile.bucketing import Bucket, smallest_fitting


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_requests: int | None
    generic_max_batch: int


def batch_cost(buckets: Sequence[Bucket], size: int, seq: int) -> int | None:
    """Padded tokens of a bucketed batch, or None when no bucket holds it."""
    bucket = smallest_fitting(buckets, size, seq)
    return None if bucket is None else bucket.capacity


def plan_batches(lengths: Sequence[int], buckets: Sequence[Bucket], limits: BatchLimits) -> list[list[int]]:
    """Indices into `lengths`, grouped into batches, shortest inputs first."""
    batches: list[list[int]] = []
    current: list[int] = []
    current_cost = 0
    current_generic = False
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]  # >= every length in `current`: sorted
        alone = batch_cost(buckets, 1, length)
        generic = alone is None
        size = len(current) + 1
        if current:
            if generic != current_generic:
                cost = None
            elif generic:
                cost = size * length if size <= limits.generic_max_batch else None
            else:
                cost = batch_cost(buckets, size, length)
                if cost is not None and cost > current_cost + alone:
                    cost = None  # padding up to a bigger bucket would cost more than a run of its own
            over_budget = cost is None or cost > limits.max_batch_tokens
            if over_budget or (limits.max_batch_requests is not None and size > limits.max_batch_requests):
                batches.append(current)
                current = []
        if not current:
            current_generic = generic
            current_cost = length if generic else alone
        else:
            current_cost = cost
        current.append(index)
    if current:
        batches.append(current)
    return batches


def batch_size_hint(buckets: Sequence[Bucket], limits: BatchLimits) -> int:
    """How many inputs make a full batch: used to size the sort window and to stop waiting."""
    largest = max((bucket.batch for bucket in buckets), default=limits.generic_max_batch)
    return min(largest, limits.max_batch_requests or largest)
