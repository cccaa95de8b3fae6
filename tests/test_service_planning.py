"""Batch planning (pure): bucket-sized batches, generic only for what no bucket holds, budgets, and
costs from measured library latencies where the artifact has them."""

from __future__ import annotations

from dataclasses import replace

from artifact.costs import CALL_TOKENS, BatchCosts, PackedCosts, unmeasured_costs
from compile.bucketing import parse_buckets
from service.planning import (
    BatchLimits,
    full_batch_size,
    most_inputs,
    plan_batches,
    shared_limits,
    wide_run_pays,
)

TINY_BUCKETS = parse_buckets("1x8,2x16,4x16")
TINY = BatchCosts(TINY_BUCKETS)  # no measurements: padded tokens
LIMITS = BatchLimits(max_batch_tokens=16384, max_batch_requests=None, generic_max_batch=16)


def shapes(lengths, batches):
    return [sorted(lengths[i] for i in batch.indices) for batch in batches]


def test_every_input_is_planned_once():
    lengths = [5, 40, 3, 12, 12, 60, 7, 16, 9, 2, 33]
    batches = plan_batches(lengths, TINY, LIMITS)
    assert sorted(i for batch in batches for i in batch.indices) == list(range(len(lengths)))


def test_a_batch_larger_than_every_bucket_is_split_into_bucket_sized_batches():
    batches = plan_batches([10] * 10, TINY, LIMITS)
    assert [len(batch.indices) for batch in batches] == [4, 4, 2]


def test_only_inputs_longer_than_every_bucket_go_generic_together():
    lengths = [12, 40, 14, 50, 13]
    planned = shapes(lengths, plan_batches(lengths, TINY, LIMITS))
    assert planned == [[12, 13, 14], [40, 50]]


def test_sorting_groups_similar_lengths():
    lengths = [3, 15, 4, 16, 2, 14]
    planned = shapes(lengths, plan_batches(lengths, TINY, LIMITS))
    # the long ones share a 4x16 call where short ones ride along for free: two calls, not four
    assert planned == [[2, 3, 4, 14], [15, 16]]


def test_no_jump_to_a_much_bigger_bucket_when_running_alone_is_cheaper():
    buckets = BatchCosts(parse_buckets("1x16,8x128"))
    assert [len(batch.indices) for batch in plan_batches([10, 10, 10], buckets, LIMITS)] == [1, 1, 1]
    assert [len(batch.indices) for batch in plan_batches([100] * 3, buckets, LIMITS)] == [3]


def test_budget_counts_padded_bucket_capacity_and_request_bound():
    small = BatchLimits(max_batch_tokens=32, max_batch_requests=None, generic_max_batch=16)
    assert [len(b.indices) for b in plan_batches([12] * 4, TINY, small)] == [2, 2]  # 4x16 = 64 > 32; 2x16 fits
    bounded = BatchLimits(max_batch_tokens=16384, max_batch_requests=3, generic_max_batch=16)
    assert [len(b.indices) for b in plan_batches([12] * 4, TINY, bounded)] == [2, 2]  # not 3 (on 4x16) + 1
    assert sorted(len(b.indices) for b in plan_batches([12] * 8, TINY, bounded)) == [2, 3, 3]  # ties: fewer calls


def test_a_full_batch_is_as_many_inputs_as_the_planner_puts_together():
    """The batcher stops waiting for company once a batch holds this many: with measured costs
    under which two 2-row calls beat one 4-row call, two inputs are already full."""
    assert full_batch_size(6, TINY, LIMITS) == 4  # padded tokens: the 4-row bucket pays
    two_rows_pay = BatchCosts(TINY_BUCKETS, {b: ms for b, ms in zip(TINY_BUCKETS, (0.06, 0.087, 0.215))},
                              lambda size, seq: 1.0)
    assert full_batch_size(6, two_rows_pay, LIMITS) == 2
    assert [len(b.indices) for b in plan_batches([6] * 4, two_rows_pay, LIMITS)] == [2, 2]
    assert full_batch_size(12, TINY, replace(LIMITS, max_batch_tokens=32)) == 2  # the token budget caps it
    # inputs longer than every bucket: the generic library takes 16 at once, not the largest bucket's 4
    assert max(len(b.indices) for b in plan_batches([40] * 32, TINY, LIMITS)) == 16
    assert full_batch_size(40, TINY, LIMITS) == 16


def test_shape_free_backend_batches_by_padded_tokens():
    limits = BatchLimits(max_batch_tokens=40, max_batch_requests=None, generic_max_batch=16)
    assert [len(b.indices) for b in plan_batches([10] * 8, BatchCosts([]), limits)] == [4, 4]
    assert most_inputs([], limits) == 16 and most_inputs(TINY_BUCKETS, replace(LIMITS, max_batch_requests=3)) == 3


# Measured on a 2-core znver4 (MiniLM): 1x128 18.5 ms, 8x128 137 ms; the generic library's fit.
MEASURED = {parse_buckets("1x16")[0]: 5.0, parse_buckets("1x128")[0]: 18.5, parse_buckets("8x128")[0]: 137.0}


def generic_ms(size: int, seq: int) -> float:
    """A shape-free library about 1.2-1.3x slower than a bucket at the bucket's own shape."""
    return 4.0 + 0.16 * size * seq + 0.0002 * size * seq * seq


def test_measured_latency_batches_what_padded_tokens_would_split():
    """8 x 1x128 (148 ms) and 1 x 8x128 (137 ms) hold the same padded tokens: by tokens they tie and
    the planner ran eight calls; by measured latency one batch wins."""
    measured = BatchCosts(list(MEASURED), MEASURED, generic_ms)
    assert measured.measured
    planned = plan_batches([112] * 8, measured, LIMITS)
    assert [(len(b.indices), b.bucket.name) for b in planned] == [(8, "8x128")]


def test_the_cheapest_fitting_bucket_runs_the_batch_not_the_smallest():
    by_name = {bucket.name: bucket for bucket in parse_buckets("2x64,4x32")}  # equal padded tokens
    costs = BatchCosts(list(by_name.values()), {by_name["2x64"]: 9.0, by_name["4x32"]: 4.0}, generic_ms)
    assert costs.choose(2, 20).bucket.name == "4x32"
    assert costs.choose(2, 50).bucket.name == "2x64"
    assert costs.choose(5, 10) is None and costs.generic(5, 10).cost == generic_ms(5, 10)


def test_a_batch_stops_growing_when_one_more_input_costs_more_than_its_own_run():
    costs = BatchCosts(list(MEASURED), MEASURED, generic_ms)
    planned = plan_batches([10, 10, 100], costs, LIMITS)
    # 10-token inputs run alone on 1x16 (5 ms each) rather than padded into 8x128 (137 ms)
    names = [(sorted(b.indices), b.bucket.name) for b in planned]
    assert names == [([0], "1x16"), ([1], "1x16"), ([2], "1x128")]


def test_missing_measurements_fall_back_to_padded_tokens():
    partial = dict(list(MEASURED.items())[:1])
    costs = BatchCosts(list(MEASURED), partial, generic_ms)
    assert not costs.measured and costs.choose(1, 100).cost == CALL_TOKENS + 128



# A packed artifact's libraries (per sequence bound): ms = 2 + 0.15 per token + 0.0003 x batch x seq^2.
def packed_model(size: int, seq: int, tokens: int) -> float:
    return 2.0 + 0.15 * tokens + 0.0003 * size * seq * seq


PACKED_BUCKETS = parse_buckets("packed-16,packed-128")
PACKED = PackedCosts(PACKED_BUCKETS, {b: packed_model for b in PACKED_BUCKETS}, packed_model)


def test_packed_costs_count_real_tokens_and_attention_padded_to_the_bound():
    assert PACKED.measured
    choice = PACKED.choose(3, 12, tokens=20)
    assert choice.bucket.name == "packed-16" and choice.computed_tokens == 20
    assert choice.cost == packed_model(3, 16, 20)
    assert PACKED.choose(2, 100, tokens=150).bucket.name == "packed-128"
    assert PACKED.choose(1, 200, tokens=200) is None and PACKED.generic(1, 200, 200).computed_tokens == 200


def test_packed_plans_fill_the_generic_bound_and_keep_long_inputs_apart():
    """No bucket shape limits a packed batch: 40 short inputs fill batches of the generic bound
    (16 here; the per-call cost is paid 3 times, not 40), and the long input runs alone rather
    than padding the short ones' attention to 128."""
    lengths = [8] * 40 + [120]
    planned = plan_batches(lengths, PACKED, LIMITS)
    assert most_inputs(PACKED_BUCKETS, LIMITS) == LIMITS.generic_max_batch == 16
    assert len(planned) == 4 and max(len(b.indices) for b in planned) == 16
    assert [(b.indices, b.bucket.name) for b in planned if 40 in b.indices] == [([40], "packed-128")]
    assert {b.bucket.name for b in planned if 40 not in b.indices} == {"packed-16"}


def test_a_bound_that_computes_more_than_its_sequences_gives_short_inputs_to_the_generic_library():
    """DeBERTa's packed bounds compute its score bias at the bound: a short query costs nearly what a
    full sequence does there, and runs on the generic library, which computes it at the query's own
    length; a long input stays on the bound. The generic library has to be GENERIC_MARGIN cheaper: two
    fits of the same kernels differ by noise, and a bound within it keeps the batch."""
    from artifact.costs import GENERIC_MARGIN

    def bias_at_the_bound(size: int, seq: int, tokens: int) -> float:
        return 2.0 + 0.15 * tokens + 0.003 * size * seq * seq

    def generic_at(factor: float):
        return lambda size, seq, tokens: factor * (2.0 + 0.15 * tokens + 0.003 * size * seq * seq)

    bound = parse_buckets("packed-128")
    costs = PackedCosts(bound, {b: bias_at_the_bound for b in bound}, generic_at(1.0), generic_max_batch=16)
    planned = plan_batches([8, 120], costs, LIMITS)
    assert [(b.indices, b.bucket and b.bucket.name) for b in planned] == [([0], None), ([1], "packed-128")]
    assert costs.bucket_for(1, 8) is None and costs.choose(1, 8).cost == generic_at(1.0)(1, 8, 8)
    near = PackedCosts(bound, {b: bias_at_the_bound for b in bound},
                       lambda size, seq, tokens: bias_at_the_bound(size, 128, tokens) / 1.2, generic_max_batch=16)
    assert GENERIC_MARGIN > 1.2 and near.bucket_for(1, 8) == bound[0]


def test_unmeasured_packed_costs_are_tokens():
    costs = unmeasured_costs(PACKED_BUCKETS)
    assert isinstance(costs, PackedCosts) and not costs.measured
    assert costs.choose(2, 10, tokens=15).cost == CALL_TOKENS + 15 + 2 * 16


def test_queued_inputs_are_shared_between_workers_not_planned_into_one_call():
    """32 queued inputs and two 1-thread workers: batches of at most 16, so both cores work."""
    one_worker = plan_batches([8] * 32, PACKED, shared_limits(LIMITS, 32, workers=1))
    two_workers = plan_batches([8] * 32, PACKED, shared_limits(LIMITS, 32, workers=2))
    assert max(len(b.indices) for b in one_worker) == LIMITS.generic_max_batch
    assert sorted(len(b.indices) for b in two_workers) == [16, 16]
    assert shared_limits(LIMITS, 5, workers=2).max_batch_requests == 3
    capped = BatchLimits(max_batch_tokens=16384, max_batch_requests=2, generic_max_batch=16)
    assert shared_limits(capped, 32, workers=2).max_batch_requests == 2


def test_planned_batches_carry_their_measured_cost_only_when_measured():
    measured = BatchCosts(list(MEASURED), MEASURED, generic_ms)
    assert [b.cost_ms for b in plan_batches([112] * 8, measured, LIMITS)] == [MEASURED[parse_buckets("8x128")[0]]]
    assert [b.cost_ms for b in plan_batches([5], TINY, LIMITS)] == [None]


def test_a_batch_runs_wide_only_when_nothing_is_queued_or_expected_while_it_runs():
    # a lone query on an idle server, or back to back from one client (a 4 ms round trip, 3 ms run)
    assert wide_run_pays(queued=0, arrival_rate=0.0, cost_ms=3.0)
    assert wide_run_pays(queued=0, arrival_rate=1 / 0.004, cost_ms=3.0)
    # under load: 75 requests/s, a 30 ms batch expects two arrivals that would wait for all of it
    assert not wide_run_pays(queued=0, arrival_rate=75.0, cost_ms=30.0)
    assert not wide_run_pays(queued=1, arrival_rate=0.0, cost_ms=3.0)
    assert wide_run_pays(queued=0, arrival_rate=75.0, cost_ms=None)  # unmeasured: lone batches stay wide
