"""Shape buckets as artifacts hold them: the static shape each library is built for and its order
(which one runs a batch is `artifact.costs`'s choice; parsing them from user input is the compile
stage's).

A padded artifact's bucket is a (batch, seq) shape every batch is padded to. A packed artifact's
is only a bound on the sequence length: its library takes any number of sequences and any total
token count (both symbolic), so no token is padded; attention pads each sequence to `seq`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


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

    @property
    def rows(self) -> int:
        """Full-length sequences the library runs at once (what it is validated and timed on)."""
        return self.batch

    def fits(self, batch: int, seq: int) -> bool:
        return batch <= self.batch and seq <= self.seq


@dataclass(frozen=True, order=True)
class PackedBucket:
    """A packed library for sequences of up to `seq` tokens, any number of them."""

    seq: int

    @property
    def name(self) -> str:
        return f"packed-{self.seq}"

    @property
    def rows(self) -> int:
        """Sequences it is validated and timed on: enough to cross kernel tiles, few at long `seq`."""
        return max(1, min(8, 512 // self.seq))

    def fits(self, batch: int, seq: int) -> bool:
        return seq <= self.seq


AnyBucket = Union[Bucket, PackedBucket]

