"""The dynamic batcher: admitted inputs (`service.admission`), cut into batches
(`service.planning`), run on workers within the cores (`service.lanes`), answered, measured.

A batch is formed only when a worker can take it, so inputs keep collecting while all are busy:
a worker is free, or (`Topology.queue_ahead`) runs a batch with none queued behind it yet, so
that the next one starts without waiting on this loop. Then the oldest input waits up to
`max_wait_ms` for company only when waiting can pay: when the batch is not yet as full as the
planner would make it (`full_batch_size`), and the recent rate of arrivals that find
the server busy predicts another input within that time (a lone request on an idle server, or a
client's next request sent back to back, runs at once). Each round sorts a window of a few
batches' worth of inputs by length, plans the cheapest batches, dispatches the one holding the
oldest input and puts the rest back, so nothing starves. A batch gets the wide worker (every
core) only when nothing else is queued and the arrival rate expects nothing while it runs; under
load, one core each.

Whatever raises wherever, every admitted input is answered: a result, its batch's error, 503
when the loop itself fails, or 504 past `request_timeout`; a request that ends otherwise (its
client left, so its task was cancelled) takes its queued inputs out of the queue before they run.
The loop is supervised: if it dies, queued inputs get 503 at once and it restarts after
`RESTART_BACKOFF_S` per recent death, answering 503 (and `/ready` 503) meanwhile; after
`MAX_LOOP_CRASHES` deaths within `CRASH_WINDOW_S` it stays down, `/ready` answers 503 and the
server exits non-zero so that the orchestrator replaces the process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Callable

import numpy as np

from artifact.bucketing import AnyBucket
from artifact.costs import Costs, unmeasured_costs

from .admission import Entry, InputQueue
from .backends import Backend
from .errors import BackendFailure, GatewayTimeout, Overloaded, ServiceError, Unavailable
from .lanes import Lane, Lanes
from .memory import process_memory
from .metrics import Metrics
from .planning import (
    BatchLimits,
    PlannedBatch,
    full_batch_size,
    most_inputs,
    plan_batches,
    shared_limits,
    wide_run_pays,
)
from .tokenization import Encoded

EXPANDED = 2  # a ColBERT query's expansion tokens in the attention mask (compile.checkpoint.EXPANDED)

log = logging.getLogger(__name__)

MAX_LOOP_CRASHES = 3
CRASH_WINDOW_S = 60.0
RESTART_BACKOFF_S = 0.5  # the loop restarts after this times its recent deaths: a passing fault can clear


@dataclass(frozen=True)
class ItemResult:
    output: np.ndarray  # [dim]: pooled embedding or logits; [seq, hidden]: token states (padding rows too)
    path: str
    queue_seconds: float
    inference_seconds: float
    tokens: np.ndarray | None = None  # [seq, dim]: every token's output, where its input asked for them


class Batcher:
    def __init__(self, name: str, backend: Backend, limits: BatchLimits, lanes: Lanes, *, max_wait_ms: float,
                 sort_window: int, capacity: int, request_timeout_s: float, metrics: Metrics,
                 costs: Costs | None = None, on_fatal: Callable[[], None] | None = None):
        self.name = name
        self.backend = backend
        self.limits = limits
        self.max_wait = max_wait_ms / 1000
        self.request_timeout = request_timeout_s
        self.metrics = metrics
        self.costs = costs or unmeasured_costs(backend.buckets)
        self.on_fatal = on_fatal
        metrics.register_model(name)
        self.window = sort_window * most_inputs(backend.buckets, limits)
        self._full_sizes: dict[int, int] = {}  # input length -> inputs that make a full batch
        self.queue = InputQueue(capacity)
        self.lanes = lanes  # shared by every model's batcher: one set of workers within the cores
        self.failure: str | None = None  # why the loop gave up, once it has
        self._healthy = True
        self._running: set[asyncio.Task] = set()
        self._progress = asyncio.Event()  # a batch was dispatched or finished
        self._loop_task: asyncio.Task | None = None
        self._draining = False  # shutdown has begun: queued inputs go at once, without lingering
        self._closed = False  # close() has begun: inputs are refused

    @property
    def healthy(self) -> bool:
        return self._healthy and self.failure is None

    def warmup_workers(self) -> None:
        """Warm every library on every worker thread (each gets its own VM); blocks until done.

        Each worker warms on its own thread, with no barrier between them: one that fails makes
        this raise, and start-up stops with that error instead of waiting on the others."""
        futures = [lane.submit(self.backend.warmup) for lane in self.lanes.all]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()  # the first failure, if any, without waiting for the rest
        process_memory.settle()  # warm-up's buffers go back; the idle size is the memory baseline

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._supervise(), name=f"batcher-{self.name}")

    async def submit(self, encoded: list[Encoded]) -> list[ItemResult]:
        """Queue inputs and wait for their results, in order.

        429 at once when over capacity, 413 when the request could never fit, 504 past the
        request timeout; when one input fails, the request's other queued inputs are dropped. Inputs
        still arriving once shutdown has begun are taken until `close`: their requests were received
        before the signal (the servers refuse new connections), some still tokenizing at it."""
        if self._closed:
            raise Unavailable("server is shutting down")
        if not self.healthy:
            raise Unavailable(f"the batcher is down: {self.failure or 'restarting'}")
        try:
            entries = self.queue.admit(encoded)
        except Overloaded:
            self.metrics.rejected.labels(self.name).inc(len(encoded))
            raise
        self._gauge()
        try:
            results = await asyncio.wait_for(asyncio.gather(*(entry.future for entry in entries)), self.request_timeout)
        except TimeoutError:
            self.metrics.timeouts.labels(self.name).inc()
            raise GatewayTimeout(f"no answer within the request timeout of {self.request_timeout:g} s") from None
        finally:  # answered, failed, timed out or cancelled (the client left): queued inputs leave now
            self._dropped(self.queue.release(entries))
            self._gauge()
        return list(results)

    def drain(self) -> None:
        """Shutdown has begun: what is queued, or queued from now on, is dispatched at once instead
        of lingering for company."""
        self._draining = True
        self.queue.arrived.set()

    async def close(self, deadline: float) -> bool:
        """Refuse new work, finish what is queued and running until `deadline` (loop time, shared
        by every model's batcher), stop; whether every batch finished (the lanes' owner then waits
        for their threads)."""
        self._closed = True
        self.drain()
        loop = asyncio.get_running_loop()
        while self._loop_alive() and (len(self.queue) or self._running) and loop.time() < deadline:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
            except TimeoutError:
                break
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_queued(Unavailable("server is shutting down"))
        if self._running:
            await asyncio.wait(set(self._running), timeout=max(0.0, deadline - loop.time()))
        return not self._running

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def _supervise(self) -> None:
        crashes: deque[float] = deque()
        while True:
            try:
                await self._run_forever()
                return
            except Exception as exc:  # noqa: BLE001 - whatever killed the loop, queued requests get an answer
                log.exception("the batching loop of %s failed", self.name)
                self._healthy = False
                self.metrics.loop_crashes.labels(self.name).inc()
                self._fail_queued(Unavailable(f"the batcher failed ({type(exc).__name__}: {exc}); retry the request"))
                now = time.monotonic()
                crashes.append(now)
                while now - crashes[0] > CRASH_WINDOW_S:
                    crashes.popleft()
                if len(crashes) >= MAX_LOOP_CRASHES:
                    self.failure = f"the batching loop failed {len(crashes)} times within {CRASH_WINDOW_S:g} s: {exc}"
                    log.error("%s: %s; giving up", self.name, self.failure)
                    if self.on_fatal is not None:
                        self.on_fatal()
                    return
                await asyncio.sleep(RESTART_BACKOFF_S * len(crashes))  # requests and /ready see 503 meanwhile
                self._healthy = True

    def _fail_queued(self, error: ServiceError) -> None:
        for entry in self.queue.take(len(self.queue.entries)):
            entry.future.set_exception(error)
        self._gauge()

    async def _run_forever(self) -> None:
        while True:
            await self._wait_for_work()
            await self.lanes.wait_free()
            await self._linger()
            if not self.lanes.has_free():  # another model's batcher took the worker while this one lingered
                continue
            planned = self._next_batch()
            if planned is None:
                continue
            entries, batch = planned
            lane = self.lanes.take(alone=wide_run_pays(len(self.queue), self.queue.arrival_rate(),
                                                       batch.cost_ms), cost_ms=batch.cost_ms or 0.0)
            work = self._submit(lane, entries, batch.bucket)
            task = asyncio.create_task(self._execute(entries, work, lane))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            self._progress.set()

    async def _wait_for_work(self) -> None:
        while True:
            self.queue.drop_dead_head()
            if self.queue.entries:
                return
            self.queue.arrived.clear()
            await self.queue.arrived.wait()

    def _lingering_pays(self) -> bool:
        """Another input is expected within the wait: the recent rate of arrivals that found
        company says so (`InputQueue.arrival_rate`)."""
        return self.queue.arrival_rate() * self.max_wait >= 1.0

    async def _linger(self) -> None:
        """With a worker free, let the oldest input wait up to max_wait for a fuller batch."""
        while self.queue.entries and not self._draining:
            live = [entry for entry in self.queue.entries if entry.live]
            if not live or len(live) >= self._full_size(max(len(entry.encoded) for entry in live)):
                return
            if sum(len(entry.encoded) for entry in live) >= self.limits.max_batch_tokens:
                return
            remaining = live[0].enqueued_at + self.max_wait - time.perf_counter()
            if remaining <= 0 or not self._lingering_pays():
                return
            self.queue.arrived.clear()
            try:
                await asyncio.wait_for(self.queue.arrived.wait(), remaining)
            except TimeoutError:
                return

    def _full_size(self, length: int) -> int:
        if length not in self._full_sizes:
            self._full_sizes[length] = full_batch_size(length, self.costs, self.limits)
        return self._full_sizes[length]

    def _next_batch(self) -> tuple[list[Entry], PlannedBatch] | None:
        """Sort a window of queued inputs by length; take the planned batch holding the oldest one."""
        window = self.queue.take(self.window)
        if not window:
            self._gauge()
            return None
        try:
            limits = shared_limits(self.limits, len(window), len(self.lanes.narrow))
            plan = plan_batches([len(entry.encoded) for entry in window], self.costs, limits)
            chosen = next(batch for batch in plan if 0 in batch.indices)
        except BaseException:
            self.queue.put_back(window)  # nothing taken is lost: the supervisor answers it
            raise
        taken = set(chosen.indices)
        self.queue.put_back([entry for i, entry in enumerate(window) if i not in taken])
        self._gauge()
        return [window[i] for i in chosen.indices], chosen

    def _submit(self, lane: Lane, entries: list[Entry], bucket: AnyBucket | None) -> Future:
        """Start the batch on `lane` now, not a loop turn later in `_execute`; a refusal (the lane's
        executor shut down) becomes the batch's error, so its inputs are answered and the lane freed."""
        try:
            return lane.submit(self._run, entries, bucket)
        except Exception as exc:  # noqa: BLE001 - reported to the batch's requests by _execute
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    async def _execute(self, entries: list[Entry], work: Future, lane: Lane) -> None:
        """Await the batch running on `lane`, answer its inputs, record it."""
        try:
            try:
                started, finished, result = await asyncio.wrap_future(work)
                if result is None:  # every request of the batch gave up while it waited behind another
                    self._dropped(len(entries))
                    return
                output = np.asarray(result.output)
                if output.ndim < 2 or output.shape[0] < len(entries):  # [batch, dim] or [batch, seq, hidden]
                    raise BackendFailure(f"the backend returned an output of shape {output.shape} "
                                         f"for a batch of {len(entries)}")
            finally:
                self.lanes.release(lane)
                self._progress.set()
            elapsed = finished - started
            for row, entry in enumerate(entries):
                if entry.live:
                    tokens = result.tokens[row] if entry.encoded.tokens else None
                    entry.future.set_result(ItemResult(output[row], result.path, started - entry.enqueued_at, elapsed,
                                                       tokens))
        except asyncio.CancelledError:
            if not work.cancelled():
                raise
            for entry in entries:  # queued behind another batch when the workers shut down
                entry.fail_request(Unavailable("server is shutting down"))
            return
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its own requests only
            log.exception("batch of %d failed on %s", len(entries), self.name)
            error = exc if isinstance(exc, ServiceError) else BackendFailure(f"inference failed: {exc}")
            for entry in entries:
                entry.fail_request(error)
            self.metrics.batch_failures.labels(self.name).inc()
            return
        try:
            self._record(entries, result, started, elapsed)
        except Exception:  # noqa: BLE001 - metrics never fail a request that was answered
            log.exception("recording metrics of a batch failed on %s", self.name)

    def _run(self, entries: list[Entry], bucket: AnyBucket | None):
        """Worker thread: right-pad the batch to its longest input and run it; (start, end, result),
        the times on the worker so that a batch queued behind another counts only its own run, the
        result None when no input is live any more (their requests timed out or left)."""
        started = time.perf_counter()
        if not any(entry.live for entry in entries):
            return started, started, None
        seq = max(len(entry.encoded) for entry in entries)
        input_ids = np.zeros((len(entries), seq), dtype=np.int64)
        attention_mask = np.zeros_like(input_ids)
        token_type_ids = np.zeros_like(input_ids)
        for row, entry in enumerate(entries):
            length = len(entry.encoded)
            input_ids[row, :length] = entry.encoded.ids
            attention_mask[row, :length] = 1
            attention_mask[row, entry.encoded.attended or length:length] = EXPANDED
            token_type_ids[row, :length] = entry.encoded.type_ids
        tokens = any(entry.encoded.tokens for entry in entries)  # only a batch that needs them copies them out
        result = self.backend.run(input_ids, attention_mask, token_type_ids, bucket, tokens=tokens)
        finished = time.perf_counter()
        process_memory.after_batch()  # past its limit, cached buffers go back before the next batch
        return started, finished, result

    def _gauge(self) -> None:
        self.metrics.queue_depth.labels(self.name).set(len(self.queue))
        self.metrics.admitted.labels(self.name).set(self.queue.admitted)

    def _dropped(self, inputs: int) -> None:
        if inputs:
            self.metrics.dropped.labels(self.name).inc(inputs)

    def _record(self, entries: list[Entry], result, started: float, elapsed: float) -> None:
        metrics, name = self.metrics, self.name
        for entry in entries:
            metrics.queue_seconds.labels(name).observe(started - entry.enqueued_at)
        metrics.batch_size.labels(name).observe(len(entries))
        metrics.batches.labels(name, result.path).inc()
        if result.path == "generic":
            metrics.fallbacks.labels(name).inc()
        metrics.inference_seconds.labels(name, result.path).observe(elapsed)
        metrics.tokens.labels(name).inc(result.real_tokens)
        metrics.padding_tokens.labels(name).inc(result.padding_tokens)
