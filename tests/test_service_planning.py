"""Batch planning (pure): bucket-sized batches, generic only for what no bucket holds, budgets."""

from __future__ import annotations

from compile.bucketing import parse_buckets
from service.planning import BatchLimits, batch_size_hint, plan_batches

TINY = parse_buckets("1x8,2x16,4x16")
LIMITS = BatchLimits(max_batch_tokens=16384, max_batch_requests=None, generic_max_batch=16)


def shapes(lengths, batches):
    return [sorted(lengths[i] for i in batch) for batch in batches]


def test_every_input_is_planned_once():
    lengths = [5, 40, 3, 12, 12, 60, 7, 16, 9, 2, 33]
    batches = plan_batches(lengths, TINY, LIMITS)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))


def test_a_batch_larger_than_every_bucket_is_split_into_bucket_sized_batches():
    batches = plan_batches([10] * 10, TINY, LIMITS)
    assert [len(batch) for batch in batches] == [4, 4, 2]


def test_only_inputs_longer_than_every_bucket_go_generic_together():
    lengths = [12, 40, 14, 50, 13]
    planned = shapes(lengths, plan_batches(lengths, TINY, LIMITS))
    assert planned == [[12, 13, 14], [40, 50]]


def test_sorting_groups_similar_lengths():
    lengths = [3, 15, 4, 16, 2, 14]
    planned = shapes(lengths, plan_batches(lengths, TINY, LIMITS))
    # the shortest run alone on 1x8; the long ones share 4x16, where one short input rides for free
    assert planned == [[2], [3], [4, 14, 15, 16]]


def test_no_jump_to_a_much_bigger_bucket_when_running_alone_is_cheaper():
    buckets = parse_buckets("1x16,8x128")
    assert [len(batch) for batch in plan_batches([10, 10, 10], buckets, LIMITS)] == [1, 1, 1]
    assert [len(batch) for batch in plan_batches([100] * 3, buckets, LIMITS)] == [3]


def test_budget_counts_padded_bucket_capacity_and_request_bound():
    small = BatchLimits(max_batch_tokens=32, max_batch_requests=None, generic_max_batch=16)
    assert [len(b) for b in plan_batches([12] * 4, TINY, small)] == [2, 2]  # 4x16 = 64 > 32; 2x16 fits
    bounded = BatchLimits(max_batch_tokens=16384, max_batch_requests=3, generic_max_batch=16)
    assert [len(b) for b in plan_batches([12] * 4, TINY, bounded)] == [3, 1]


def test_shape_free_backend_batches_by_padded_tokens():
    limits = BatchLimits(max_batch_tokens=40, max_batch_requests=None, generic_max_batch=16)
    assert [len(b) for b in plan_batches([10] * 8, [], limits)] == [4, 4]
    assert batch_size_hint([], limits) == 16 and batch_size_hint(TINY, LIMITS) == 4
