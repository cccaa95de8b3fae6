"""Resident memory that stays near its idle size under load.

Where it went without this (docs/soak/README.md): TVM's VM takes every intermediate tensor from a
pooled allocator that keeps each freed buffer for a later request of its page-rounded size and never
hands it back, so the activations of the largest batches seen (~5 KB a token on MiniLM) stayed
resident, each new size adding more; and glibc kept what was freed in its per-thread arenas.

`configure_allocator` (at process start) caps glibc's arenas and fixes its mmap threshold, so large
buffers are unmapped when freed. `MemoryGuard` takes the idle RSS after warm-up as its baseline;
after each batch the worker reads RSS (/proc/self/statm, microseconds) and, past `RELEASE_RATIO`
times the baseline, empties TVM's pool (buffers a running batch uses are not in it) and has glibc
return free pages to the OS (`malloc_trim`). What stays resident is the weights, the runtime and
the batches in flight, whose activations `Settings.max_batch_tokens` bounds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from typing import Callable

log = logging.getLogger(__name__)

# Past this multiple of the idle RSS after warm-up, a finished batch returns cached memory to the
# OS: low enough that two batches in flight still fit under 1.5x the idle size, high enough that
# the pool keeps serving most batches between releases.
RELEASE_RATIO = 1.2
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
MALLOC_ARENAS = 2
MMAP_THRESHOLD_BYTES = 1 << 20


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def _glibc():
    """The C library when it is glibc (it has malloc_trim and mallopt), else None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
            return None
    except OSError:
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


_GLIBC = _glibc()


def configure_allocator() -> None:
    """At process start, before any thread: `MALLOC_ARENAS` arenas instead of 8 per core, and a
    fixed mmap threshold, so a large buffer (activations, from 1 MiB) is mapped and unmapped whole
    instead of left in an arena once glibc's adaptive threshold has grown past it. The variables
    glibc reads (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_) win when the environment sets them."""
    if _GLIBC is None:
        return
    if "MALLOC_ARENA_MAX" not in os.environ:
        _GLIBC.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _GLIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def release_cached_memory() -> None:
    """Free the buffers TVM's pooled allocator holds but no batch uses, then trim the C heap."""
    tvm = sys.modules.get("tvm")
    if tvm is not None:
        clear = tvm.get_global_func("vm.builtin.memory_manager.clear", allow_missing=True)
        if clear is not None:
            clear()
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


class MemoryGuard:
    """Keeps RSS within `ratio` x its idle size after warm-up, releasing cached memory past it."""

    def __init__(self, ratio: float = RELEASE_RATIO, read: Callable[[], int | None] = resident_bytes,
                 release: Callable[[], None] = release_cached_memory):
        self.ratio, self._read, self._release = ratio, read, release
        self.baseline: int | None = None  # idle RSS after warm-up, once taken
        self.releases = 0
        self._lock = threading.Lock()  # two workers finishing at once release once

    @property
    def limit(self) -> int | None:
        return None if self.baseline is None else int(self.baseline * self.ratio)

    def settle(self) -> None:
        """After warm-up: return what warming cached, then take the idle RSS as the baseline (each
        model's warm-up calls this, so with several models the last one's counts)."""
        self._release()
        self.baseline = self._read()
        log.debug("idle RSS after warm-up: %s bytes", self.baseline)

    def after_batch(self) -> None:
        """On a worker, after its batch: release cached memory when RSS is past the limit."""
        limit = self.limit
        if limit is None:
            return
        resident = self._read()
        if resident is None or resident <= limit or not self._lock.acquire(blocking=False):
            return
        try:
            self._release()
            self.releases += 1
        finally:
            self._lock.release()


process_memory = MemoryGuard()  # RSS and the allocators are the process's: one guard for every model
