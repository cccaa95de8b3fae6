"""Inference workers ("lanes") and the accounting that keeps them within the cores.

Each lane is one OS thread (a single-thread executor) whose intra-op pool is sized once, on that
thread, by the backend's `configure_thread`; each thread also gets its own TVM VM. The narrow
lanes run side by side; the wide lane (every core) runs only when nothing else does. One set of
lanes serves every model of the server, so several models never oversubscribe the cores. All
bookkeeping happens on the event loop, so it needs no locks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .topology import Topology


@dataclass(eq=False)
class Lane:
    name: str
    threads: int
    executor: ThreadPoolExecutor = field(repr=False)
    busy: bool = False

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
        self._released = asyncio.Event()

    @property
    def all(self) -> list[Lane]:
        return self.narrow + ([self.wide] if self.wide else [])

    def idle(self) -> bool:
        return not any(lane.busy for lane in self.all)

    def has_free(self) -> bool:
        return not (self.wide and self.wide.busy) and any(not lane.busy for lane in self.narrow)

    async def wait_free(self) -> None:
        while not self.has_free():
            self._released.clear()
            await self._released.wait()

    def take(self, alone: bool) -> Lane:
        """A free lane: the wide one when this batch is the only work, else a narrow one."""
        if alone and self.wide is not None and self.idle():
            chosen = self.wide
        else:
            chosen = next(lane for lane in self.narrow if not lane.busy)
        chosen.busy = True
        return chosen

    def release(self, lane: Lane) -> None:
        lane.busy = False
        self._released.set()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads; `wait=False` leaves a stuck one behind instead of hanging shutdown."""
        for lane in self.all:
            lane.executor.shutdown(wait=wait, cancel_futures=True)
