"""argparse types the tools share, so that a bad value is one line and exit 2, not a traceback later."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """A count of calls, rounds or threads: 0 would leave nothing to take a median of."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
