"""The loader's weights: one region, each weight 64-byte aligned in it, the region on a 2 MB boundary
and advised to Linux as huge pages (`artifact.loader.on_huge_pages`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from artifact.loader import HUGE_PAGE, on_huge_pages
from artifact.packed_batch import ALIGNMENT


def _mapping_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping that holds `address`."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path(f"/proc/{os.getpid()}/smaps").read_text())
    for entry in entries:
        start, end = (int(bound, 16) for bound in entry.split(None, 1)[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weights_are_copied_into_one_region_advised_as_huge_pages():
    arrays = [np.arange(3000, dtype=np.float32).reshape(30, 100), np.arange(7, dtype=np.uint16),
              np.arange(-8, 7, dtype=np.int8).reshape(3, 5), np.full((2, 2), 5, dtype=np.int32)]
    tensors = on_huge_pages(arrays)
    shared = [np.from_dlpack(tensor) for tensor in tensors]
    for array, loaded in zip(arrays, shared):
        assert loaded.dtype == array.dtype and loaded.shape == array.shape and np.array_equal(loaded, array)
    starts = [view.ctypes.data for view in shared]
    assert starts[0] % HUGE_PAGE == 0 and all(start % ALIGNMENT == 0 for start in starts)
    assert all(start + view.nbytes <= following for start, view, following in zip(starts, shared, starts[1:]))
    assert starts[-1] - starts[0] < HUGE_PAGE  # one after another, not each its own allocation
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    eligible = re.search(r"^THPeligible:\s+(\d)", _mapping_of(starts[0]), re.MULTILINE)
    if mode.is_file() and eligible:  # a kernel that reports it: advised, unless THP is off altogether
        assert eligible[1] == ("0" if "[never]" in mode.read_text() else "1")
