"""Driving a server with bounded traffic: closed-loop concurrency and open-loop arrival rates, over
the lean client of `loadtest.http_client` (the generator shares the cores of the server it measures).

Every request that is sent ends as an outcome (answered, HTTP error or transport error), so
`sent == len(outcomes)` always: nothing is silently lost. Every loop stops by count or time.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from .http_client import Connection
from .workload import Request

ZERO_SHOT_LABELS = ["sports", "weather", "technology", "music"]


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no HTTP answer (timeout, connection error)
    latency_s: float
    tokens: int
    compute_path: str | None


def request_body(endpoint: str, request: Request) -> dict:
    body = {"inputs": request.inputs, "truncate": True}
    if endpoint == "/classify":
        body["labels"] = ZERO_SHOT_LABELS
    return body


async def _send(connection: Connection, endpoint: str, request: Request, tokens: int, timeout: float) -> Outcome:
    started = time.perf_counter()
    try:
        answer = await connection.post(endpoint, request_body(endpoint, request), timeout)
        return Outcome(answer.status, time.perf_counter() - started, tokens, answer.headers.get("x-compute-path"))
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
        return Outcome(None, time.perf_counter() - started, tokens, None)


async def closed_loop(base: str, endpoint: str, requests: list[Request], tokens: list[int],
                      concurrency: int, time_limit: float, timeout: float = 60.0) -> tuple[list[Outcome], float]:
    """`concurrency` clients, each on its own kept-alive connection, sending its next request as
    soon as the last one returns."""
    outcomes: list[Outcome] = []
    pending = iter(range(len(requests)))
    deadline = time.perf_counter() + time_limit

    async def client_loop() -> None:
        connection = Connection(base)
        try:
            for index in pending:
                if time.perf_counter() > deadline:
                    return
                outcomes.append(await _send(connection, endpoint, requests[index], tokens[index], timeout))
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - started


async def open_loop(base: str, endpoint: str, requests: list[Request], tokens: list[int],
                    rate: float, time_limit: float, seed: int = 0, timeout: float = 60.0) -> tuple[list[Outcome], float]:
    """Poisson arrivals at `rate` requests/s, independent of how fast the server answers (each on a
    kept-alive connection that is free, or a new one)."""
    rng = random.Random(seed)
    idle: list[Connection] = []
    everyone: list[Connection] = []

    async def send(request: Request, count: int) -> Outcome:
        if not idle:
            everyone.append(Connection(base))
            idle.append(everyone[-1])
        connection = idle.pop()
        outcome = await _send(connection, endpoint, request, count, timeout)
        idle.append(connection)
        return outcome

    tasks = []
    started = time.perf_counter()
    next_arrival = started
    for index, request in enumerate(requests):
        next_arrival += rng.expovariate(rate)
        if next_arrival - started > time_limit:
            break
        await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(send(request, tokens[index])))
    outcomes = list(await asyncio.gather(*tasks))
    elapsed = time.perf_counter() - started
    for connection in everyone:
        await connection.close()
    return outcomes, elapsed
