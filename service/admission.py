"""Admission: the bounded queue of tokenised inputs, and how fast they arrive.

Admission is counted in inputs (queued or running), like TEI's `max_concurrent_requests`
permits: a request that does not fit now is refused at once (429), one that could never fit is
413, so memory stays bounded. Every admitted input belongs to a request; when any input of a
request fails, times out or is abandoned (its client left: the request's task is cancelled), its
inputs still queued leave the queue at once, before they run, and the count always comes back.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import Overloaded, TooLarge
from .tokenization import Encoded

# Weight of the newest inter-arrival gap in the arrival-rate estimate (an exponential moving
# average over roughly the last 1 / ARRIVAL_SMOOTHING requests).
ARRIVAL_SMOOTHING = 0.2


@dataclass(eq=False)
class Entry:
    encoded: Encoded
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)
    request: list[Entry] = field(default_factory=list, repr=False)  # every input of its request, itself included
    queued: bool = False  # in the queue (not yet taken into a batch)

    @property
    def live(self) -> bool:
        """Still wanted: its request has neither failed, timed out nor been abandoned."""
        return not self.future.done()

    def fail_request(self, error: BaseException) -> None:
        """Fail this input and, at once, the other inputs of its request: nobody waits for them."""
        for entry in self.request or [self]:
            if entry.live:
                entry.future.set_exception(error)


class InputQueue:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.perf_counter):
        self.capacity = capacity
        self._clock = clock  # seconds; arrivals are timed by it (tests pass their own)
        self.entries: deque[Entry] = deque()
        self.admitted = 0  # inputs queued or running, of requests still waiting
        self._last_arrival: float | None = None
        self._mean_gap = math.inf
        self._company_share = 0.0  # of recent arrivals, those that found other requests in the server
        self.arrived = asyncio.Event()

    def admit(self, encoded: list[Encoded]) -> list[Entry]:
        if len(encoded) > self.capacity:
            raise TooLarge(f"{len(encoded)} inputs can never fit the server's queue of {self.capacity} "
                           f"(--max-concurrent-requests); send at most {self.capacity} per request")
        if self.admitted + len(encoded) > self.capacity:
            raise Overloaded()
        self._note_arrival(found_company=self.admitted > 0)
        loop = asyncio.get_running_loop()
        entries = [Entry(item, loop.create_future()) for item in encoded]
        for entry in entries:
            entry.request = entries
        self.admitted += len(entries)
        self._enqueue(entries)
        self.entries.extend(entries)
        self.arrived.set()
        return entries

    def release(self, entries: list[Entry]) -> int:
        """The request is over (answered, failed, timed out or abandoned): its inputs stop counting
        and those still queued leave the queue now, so none of them runs; how many left it."""
        for entry in entries:
            if not entry.future.done():
                entry.future.cancel()
        self.admitted -= len(entries)
        dropped = [entry for entry in entries if entry.queued]
        if dropped:
            for entry in dropped:
                entry.queued = False
            kept = [entry for entry in self.entries if entry.queued]
            self.entries.clear()
            self.entries.extend(kept)
        return len(dropped)

    def take(self, count: int) -> list[Entry]:
        """Up to `count` live inputs, oldest first (dropped ones are discarded on the way)."""
        taken: list[Entry] = []
        while self.entries and len(taken) < count:
            entry = self.entries.popleft()
            entry.queued = False
            if entry.live:
                taken.append(entry)
        return taken

    def put_back(self, entries: list[Entry]) -> None:
        """Return inputs to the head of the queue, in their order."""
        self._enqueue(entries)
        self.entries.extendleft(reversed(entries))

    def __len__(self) -> int:
        """Inputs queued: a request's inputs leave the queue when it ends, so this needs no recount."""
        return len(self.entries)

    def drop_dead_head(self) -> None:
        while self.entries and not self.entries[0].live:
            self.entries.popleft().queued = False

    @staticmethod
    def _enqueue(entries: list[Entry]) -> None:
        for entry in entries:
            entry.queued = True

    def arrival_rate(self) -> float:
        """Requests per second that arrive while others are in the server: the recent rate (decayed
        by the silence since the last arrival) times the share of recent arrivals that found
        company. A client sending back to back waits for each answer before its next request: at
        any rate its requests find the server empty, and waiting for a next one only delays it."""
        if self._last_arrival is None:
            return 0.0
        silence = self._clock() - self._last_arrival
        return self._company_share / max(self._mean_gap, silence, 1e-6)

    def _note_arrival(self, found_company: bool) -> None:
        now = self._clock()
        if self._last_arrival is not None:
            gap = now - self._last_arrival
            self._mean_gap = gap if math.isinf(self._mean_gap) else (
                ARRIVAL_SMOOTHING * gap + (1 - ARRIVAL_SMOOTHING) * self._mean_gap)
        self._company_share = ARRIVAL_SMOOTHING * found_company + (1 - ARRIVAL_SMOOTHING) * self._company_share
        self._last_arrival = now
