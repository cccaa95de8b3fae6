"""Progress lines on stderr for long compiles, and the closing summary table."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, TextIO


class Progress:
    """Prints `[compile 3/9] build bucket 8x128 ... 2.1 s` (`[compile x86-64-v4 3/9]` for one level of
    several); silent when quiet."""

    def __init__(self, total: int, stream: TextIO | None = None, quiet: bool = False, label: str = ""):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.label = label

    def for_level(self, mcpu: str) -> "Progress":
        """The progress of one CPU level's compile: its own steps, counted from 1, named by the level."""
        return Progress(0, self.stream, self.quiet, label=mcpu)

    def set_total(self, total: int) -> None:
        self.total = total

    def _print(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line inside the current step, for steps long enough to need one (minutes)."""
        self._print(f"    {text}")

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        self.done += 1
        prefix = f"[compile {self.label + ' ' if self.label else ''}{self.done}/{self.total}] {description}"
        started = time.perf_counter()
        self._print(f"{prefix} ...")
        yield
        self._print(f"{prefix} done in {time.perf_counter() - started:.1f} s")


def summary_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
