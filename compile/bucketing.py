"""Shape buckets: parsing, ordering, and choosing the smallest bucket that fits a batch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import CompileError

_BUCKET_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Bucket:
    """A static (batch, seq) shape, ordered by padded tokens, then by sequence length.

    On equal padded tokens the shorter sequence wins: attention costs batch x seq^2.
    """

    capacity: int
    seq: int
    batch: int

    @classmethod
    def of(cls, batch: int, seq: int) -> "Bucket":
        return cls(capacity=batch * seq, seq=seq, batch=batch)

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.seq}"

    def fits(self, batch: int, seq: int) -> bool:
        return batch <= self.batch and seq <= self.seq


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


def smallest_fitting(buckets: Sequence[Bucket], batch: int, seq: int) -> Bucket | None:
    """The bucket with the least padded work that holds (batch, seq), or None."""
    fitting = [bucket for bucket in buckets if bucket.fits(batch, seq)]
    return min(fitting, default=None)
