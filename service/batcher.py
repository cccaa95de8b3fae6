"""The dynamic batcher: a bounded queue of tokenised inputs, cut into batches, run on worker threads.

Admission is counted in inputs (queued or running), like TEI's `max_concurrent_requests`
permits; a request that does not fit is refused at once (429), so memory stays bounded. A
batch is formed only when a worker is free, so inputs keep collecting while all are busy; the
oldest input waits at most `max_wait_ms` for company when a worker is idle. Each round sorts a
window of a few batches' worth of inputs by length (`planning.plan_batches`), dispatches the
batch holding the oldest input and puts the rest back, so nothing starves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .backends import Backend
from .errors import BackendFailure, Overloaded, Unavailable
from .metrics import Metrics
from .planning import BatchLimits, batch_size_hint, plan_batches
from .tokenization import Encoded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemResult:
    output: np.ndarray  # [dim]: pooled embedding or logits
    path: str
    queue_seconds: float
    inference_seconds: float


@dataclass
class _Entry:
    encoded: Encoded
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, name: str, backend: Backend, limits: BatchLimits, *, workers: int, max_wait_ms: float,
                 sort_window: int, capacity: int, metrics: Metrics):
        self.name = name
        self.backend = backend
        self.limits = limits
        self.workers = workers
        self.max_wait = max_wait_ms / 1000
        self.capacity = capacity
        self.metrics = metrics
        metrics.register_model(name)
        self.batch_size = batch_size_hint(backend.buckets, limits)
        self.window = sort_window * self.batch_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"infer-{name}")
        self._queue: deque[_Entry] = deque()
        self._admitted = 0
        self._running: set[asyncio.Task] = set()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(workers)
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    def warmup_workers(self) -> None:
        """Warm every library on every worker thread (each gets its own VM); blocks until done."""
        barrier = threading.Barrier(self.workers)

        def warm() -> None:
            self.backend.warmup()
            barrier.wait()  # holds this thread, so each task lands on a different worker

        for future in [self._pool.submit(warm) for _ in range(self.workers)]:
            future.result()

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run_forever(), name=f"batcher-{self.name}")

    async def submit(self, encoded: list[Encoded]) -> list[ItemResult]:
        """Queue inputs and wait for their results, in order; 429 at once when over capacity."""
        if self._closing:
            raise Unavailable("server is shutting down")
        if self._admitted + len(encoded) > self.capacity:
            self.metrics.rejected.labels(self.name).inc(len(encoded))
            raise Overloaded()
        loop = asyncio.get_running_loop()
        entries = [_Entry(item, loop.create_future()) for item in encoded]
        self._admitted += len(entries)
        self._queue.extend(entries)
        self.metrics.queue_depth.labels(self.name).set(len(self._queue))
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(entry.future for entry in entries)))
        finally:
            self._admitted -= len(entries)

    async def close(self) -> None:
        """Refuse new work, finish what is queued and running, then stop the threads."""
        self._closing = True
        while self._queue or self._running:
            self._arrived.set()
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._pool.shutdown(wait=True)

    async def _run_forever(self) -> None:
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._slots.acquire()
            await self._linger()
            batch = self._next_batch()
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _linger(self) -> None:
        """With a worker free, let the oldest input wait up to max_wait for a fuller batch."""
        while self._queue and not self._closing:
            if len(self._queue) >= self.batch_size:
                return
            if sum(len(entry.encoded) for entry in self._queue) >= self.limits.max_batch_tokens:
                return
            remaining = self._queue[0].enqueued_at + self.max_wait - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _next_batch(self) -> list[_Entry]:
        """Sort a window of queued inputs by length; take the batch holding the oldest one."""
        window: list[_Entry] = []
        while self._queue and len(window) < self.window:
            entry = self._queue.popleft()
            if not entry.future.done():  # its request was cancelled
                window.append(entry)
        if not window:
            self.metrics.queue_depth.labels(self.name).set(len(self._queue))
            return []
        plan = plan_batches([len(entry.encoded) for entry in window], self.backend.buckets, self.limits)
        chosen = next(batch for batch in plan if 0 in batch)
        taken = set(chosen)
        self._queue.extendleft(reversed([entry for i, entry in enumerate(window) if i not in taken]))
        self.metrics.queue_depth.labels(self.name).set(len(self._queue))
        return [window[i] for i in chosen]

    async def _execute(self, batch: list[_Entry]) -> None:
        started = time.perf_counter()
        for entry in batch:
            self.metrics.queue_seconds.labels(self.name).observe(started - entry.enqueued_at)
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, batch)
        except Exception as exc:  # one bad batch fails its own requests only
            log.exception("batch of %d failed on %s", len(batch), self.name)
            self.metrics.batch_failures.labels(self.name).inc()
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(BackendFailure(f"inference failed: {exc}"))
            return
        finally:
            self._slots.release()
        elapsed = time.perf_counter() - started
        self._record(len(batch), result, elapsed)
        for row, entry in enumerate(batch):
            if not entry.future.done():
                entry.future.set_result(ItemResult(result.output[row], result.path, started - entry.enqueued_at, elapsed))

    def _run(self, batch: list[_Entry]):
        """Worker thread: right-pad the batch to its longest input and run it."""
        seq = max(len(entry.encoded) for entry in batch)
        input_ids = np.zeros((len(batch), seq), dtype=np.int64)
        attention_mask = np.zeros_like(input_ids)
        token_type_ids = np.zeros_like(input_ids)
        for row, entry in enumerate(batch):
            length = len(entry.encoded)
            input_ids[row, :length] = entry.encoded.ids
            attention_mask[row, :length] = 1
            token_type_ids[row, :length] = entry.encoded.type_ids
        return self.backend.run(input_ids, attention_mask, token_type_ids)

    def _record(self, size: int, result, elapsed: float) -> None:
        metrics, name = self.metrics, self.name
        metrics.batch_size.labels(name).observe(size)
        metrics.batches.labels(name, result.path).inc()
        if result.path == "generic":
            metrics.fallbacks.labels(name).inc()
        metrics.inference_seconds.labels(name, result.path).observe(elapsed)
        metrics.tokens.labels(name).inc(result.real_tokens)
        metrics.padding_tokens.labels(name).inc(result.padding_tokens)
