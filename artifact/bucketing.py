"""Shape buckets as artifacts hold them: a static (batch, seq) shape, its order, and the choice of
the smallest one that fits a batch (parsing them from user input is the compile stage's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


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


def smallest_fitting(buckets: Sequence[Bucket], batch: int, seq: int) -> Bucket | None:
    """The bucket with the least padded work that holds (batch, seq), or None."""
    fitting = [bucket for bucket in buckets if bucket.fits(batch, seq)]
    return min(fitting, default=None)
