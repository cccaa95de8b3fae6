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
        self.phase_seconds: dict[str, float] = {}  # wall time per phase, in the order they ran
        self.started: float | None = None

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
    def step(self, description: str, phase: str | None = None) -> Iterator[None]:
        """One step; its wall time counts towards `phase` (default: the step's first word) in `summary`."""
        self.done += 1
        prefix = f"[compile {self.label + ' ' if self.label else ''}{self.done}/{self.total}] {description}"
        started = time.perf_counter()
        self.started = self.started or started
        self._print(f"{prefix} ...")
        yield
        seconds = time.perf_counter() - started
        phase = phase or description
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        self._print(f"{prefix} done in {seconds:.1f} s")

    def summary(self) -> None:
        """One line: the wall time of each phase, and in all since the first step began."""
        if self.started is None:
            return
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phase_seconds.items())
        total = time.perf_counter() - self.started
        self._print(f"[compile {self.label + ' ' if self.label else ''}time] {phases}; {total:.1f} s in all")


def summary_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
