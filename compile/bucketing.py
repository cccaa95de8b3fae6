"""Parsing shape buckets from flags and configs ("8x128"); the Bucket itself is the artifact's
(`artifact.bucketing`)."""

from __future__ import annotations

import re
from typing import Iterable

from artifact.bucketing import Bucket

from .errors import CompileError

_BUCKET_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_bucket(text: str) -> Bucket:
    """Parse "8x128" into a Bucket, refusing malformed or zero-sized shapes."""
    match = _BUCKET_RE.match(str(text))
    if not match:
        raise CompileError(f"malformed bucket {text!r}: expected BATCHxSEQ, e.g. 8x128")
    batch, seq = int(match.group(1)), int(match.group(2))
    if batch <= 0 or seq <= 0:
        raise CompileError(f"bucket {text!r} has a zero dimension: batch and seq must be >= 1")
    return Bucket.of(batch, seq)


def parse_buckets(items: Iterable[str] | str) -> list[Bucket]:
    """Parse a comma-separated string or a list of "BxS" strings; sorted, duplicates removed."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    buckets = sorted({parse_bucket(item) for item in items})
    if not buckets:
        raise CompileError("no buckets given: pass at least one BATCHxSEQ")
    return buckets
