"""Parsing shape buckets from flags and configs ("8x128" padded, "packed-128" packed); the buckets
themselves are the artifact's (`artifact.bucketing`)."""

from __future__ import annotations

import re
from typing import Iterable

from artifact.bucketing import AnyBucket, Bucket, PackedBucket

from .errors import CompileError

_BUCKET_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_PACKED_RE = re.compile(r"^\s*(?:packed-)?(\d+)\s*$")


def parse_bucket(text: str) -> AnyBucket:
    """Parse "8x128" into a Bucket and "packed-128" (or "128") into a PackedBucket, refusing
    malformed or zero-sized shapes."""
    match = _BUCKET_RE.match(str(text))
    packed = _PACKED_RE.match(str(text))
    if not match and not packed:
        raise CompileError(f"malformed bucket {text!r}: expected BATCHxSEQ (e.g. 8x128), or packed-SEQ for --layout packed")
    dims = [int(d) for d in (match or packed).groups()]
    if 0 in dims:
        raise CompileError(f"bucket {text!r} has a zero dimension: batch and seq must be >= 1")
    return Bucket.of(*dims) if match else PackedBucket(dims[0])


def parse_buckets(items: Iterable[str] | str) -> list[AnyBucket]:
    """Parse a comma-separated string or a list of bucket strings; sorted, duplicates removed."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    parsed = {parse_bucket(item) for item in items}
    if len({type(bucket) for bucket in parsed}) > 1:
        raise CompileError("buckets mix padded (BATCHxSEQ) and packed (packed-SEQ) shapes; an artifact has one layout")
    buckets = sorted(parsed)
    if not buckets:
        raise CompileError("no buckets given: pass at least one BATCHxSEQ")
    return buckets
