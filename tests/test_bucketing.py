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
