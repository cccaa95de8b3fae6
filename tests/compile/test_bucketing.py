import pytest

from artifact.bucketing import Bucket
from artifact.costs import BatchCosts
from compile.bucketing import parse_bucket, parse_buckets
from compile.errors import CompileError


def test_parse_sorts_and_dedups():
    buckets = parse_buckets("8x128, 1x16,8x128,32x128")
    assert [b.name for b in buckets] == ["1x16", "8x128", "32x128"]


@pytest.mark.parametrize("text", ["8by128", "8x", "x16", "-1x16", "8x128x2", ""])
def test_malformed_bucket_is_refused(text):
    with pytest.raises(CompileError, match="malformed"):
        parse_bucket(text)


@pytest.mark.parametrize("text", ["0x16", "8x0"])
def test_zero_sized_bucket_is_refused(text):
    with pytest.raises(CompileError, match="zero"):
        parse_bucket(text)


def test_unmeasured_costs_choose_the_least_padded_work():
    costs = BatchCosts(parse_buckets("1x128,4x32,8x128"))  # no latencies: padded tokens decide
    assert costs.choose(1, 20).bucket == Bucket.of(4, 32)  # 128 tokens either way; the shorter attention
    assert costs.choose(1, 100).bucket == Bucket.of(1, 128)
    assert costs.choose(5, 10).bucket == Bucket.of(8, 128)
    assert costs.choose(9, 10) is None
    assert costs.choose(1, 129) is None


def test_the_bucket_a_model_runs_is_the_one_the_planner_costs():
    """`bucket_for` (the loader's choice, without a cost) is `choose`'s bucket at every shape, padded
    and packed, measured or not."""
    from artifact.bucketing import PackedBucket
    from artifact.costs import PackedCosts

    padded = parse_buckets("1x128,4x32,8x128")
    measured = BatchCosts(padded, {b: ms for b, ms in zip(padded, (3.0, 2.0, 9.0))}, lambda size, seq: 50.0)
    packed = [PackedBucket(16), PackedBucket(128)]
    models = {b: (lambda size, seq, tokens, b=b: 1.0 + tokens + b.seq) for b in packed}
    cheap_generic = PackedCosts(packed, models, lambda size, seq, tokens: 0.1 * tokens, generic_max_batch=4)
    for costs in (BatchCosts(padded), measured, PackedCosts(packed), PackedCosts(packed, models, lambda *a: 99.0),
                  cheap_generic):
        for size, seq in [(1, 1), (1, 16), (1, 17), (3, 20), (5, 10), (8, 128), (9, 10), (1, 129)]:
            choice = costs.choose(size, seq)
            assert costs.bucket_for(size, seq) == (None if choice is None else choice.bucket), (costs, size, seq)
    assert PackedCosts(packed).bucket_for(4, 17) == PackedBucket(128) and PackedCosts(packed).bucket_for(1, 200) is None
    assert cheap_generic.bucket_for(3, 20) is None and cheap_generic.choose(3, 20).cost == 6.0
    assert cheap_generic.bucket_for(5, 10) == PackedBucket(16)  # more rows than the generic library's bound
