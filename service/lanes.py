"""Inference workers ("lanes") and the accounting that keeps them within the cores.

Each lane is one OS thread (a single-thread executor) whose intra-op pool is sized once, on that
thread, by the backend's `configure_thread`; each thread also gets its own TVM VM. The narrow
lanes run side by side; the wide lane (every core) runs only when nothing else does. One set of
lanes serves every model of the server, so several models never oversubscribe the cores. All
bookkeeping happens on the event loop, so it needs no locks.

With `queue_ahead` a busy narrow lane also takes one batch queued behind its running one: the
worker starts it the moment it is done, instead of idling its core until the event loop has
woken up, answered the finished batch and planned the next (docs/PERFORMANCE.md measures both).
A batch only ever goes to the narrow lane expected to be free first (from the measured costs of
what it holds); when that one is full the batch waits, rather than queue behind a long batch on
another lane.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .topology import Topology


@dataclass(eq=False)
class Lane:
    name: str
    threads: int
    executor: ThreadPoolExecutor = field(repr=False)
    batches: int = 0  # submitted and not yet released: the running one and any queued behind it
    free_at: float = 0.0  # when those are expected to be done (perf_counter seconds, from their costs)

    @property
    def busy(self) -> bool:
        return self.batches > 0

    def submit(self, fn: Callable, *args) -> Future:
        return self.executor.submit(fn, *args)


class Lanes:
    def __init__(self, topology: Topology, configure_thread: Callable[[int], None]):
        def lane(label: str, threads: int) -> Lane:
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"infer-{label}",
                                          initializer=configure_thread, initargs=(threads,))
            return Lane(label, threads, executor)

        self.topology = topology
        self.narrow = [lane(str(i), topology.threads_per_worker) for i in range(topology.workers)]
        self.wide = lane("wide", topology.cores) if topology.wide else None
        self.slots = 2 if topology.queue_ahead else 1  # batches a narrow lane may hold at once
        self._released = asyncio.Event()

    @property
    def all(self) -> list[Lane]:
        return self.narrow + ([self.wide] if self.wide else [])

    def idle(self) -> bool:
        return not any(lane.busy for lane in self.all)

    def has_free(self) -> bool:
        return not (self.wide and self.wide.busy) and self._first_free().batches < self.slots

    async def wait_free(self) -> None:
        while not self.has_free():
            self._released.clear()
            await self._released.wait()

    def take(self, alone: bool, cost_ms: float = 0.0) -> Lane:
        """A lane for a batch expected to run `cost_ms` (call when `has_free`): the wide one when
        this batch is the only work, else the narrow one expected to be free first."""
        chosen = self.wide if alone and self.wide is not None and self.idle() else self._first_free()
        chosen.free_at = max(chosen.free_at, time.perf_counter()) + cost_ms / 1000
        chosen.batches += 1
        return chosen

    def _first_free(self) -> Lane:
        return min(self.narrow, key=lambda lane: lane.free_at if lane.busy else -1.0)

    def release(self, lane: Lane) -> None:
        lane.batches -= 1
        self._released.set()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads; `wait=False` leaves a stuck one behind instead of hanging shutdown."""
        for lane in self.all:
            lane.executor.shutdown(wait=wait, cancel_futures=True)
