"""Driving a server with bounded traffic: closed-loop concurrency and open-loop arrival rates.

Every request that is sent ends as an outcome (answered, HTTP error or transport error), so
`sent == len(outcomes)` always: nothing is silently lost. Every loop stops by count or time.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

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


async def _send(client: httpx.AsyncClient, endpoint: str, request: Request, tokens: int, timeout: float) -> Outcome:
    started = time.perf_counter()
    try:
        response = await client.post(endpoint, json=request_body(endpoint, request), timeout=timeout)
        return Outcome(response.status_code, time.perf_counter() - started, tokens,
                       response.headers.get("x-compute-path"))
    except httpx.HTTPError:
        return Outcome(None, time.perf_counter() - started, tokens, None)


async def closed_loop(base: str, endpoint: str, requests: list[Request], tokens: list[int],
                      concurrency: int, time_limit: float, timeout: float = 60.0) -> tuple[list[Outcome], float]:
    """`concurrency` clients, each sending its next request as soon as the last one returns."""
    outcomes: list[Outcome] = []
    pending = iter(range(len(requests)))
    deadline = time.perf_counter() + time_limit

    async def client_loop(client: httpx.AsyncClient) -> None:
        for index in pending:
            if time.perf_counter() > deadline:
                return
            outcomes.append(await _send(client, endpoint, requests[index], tokens[index], timeout))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return outcomes, time.perf_counter() - started


async def open_loop(base: str, endpoint: str, requests: list[Request], tokens: list[int],
                    rate: float, time_limit: float, seed: int = 0, timeout: float = 60.0) -> tuple[list[Outcome], float]:
    """Poisson arrivals at `rate` requests/s, independent of how fast the server answers."""
    rng = random.Random(seed)
    tasks = []
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        next_arrival = started
        for index, request in enumerate(requests):
            next_arrival += rng.expovariate(rate)
            if next_arrival - started > time_limit:
                break
            await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(_send(client, endpoint, request, tokens[index], timeout)))
        outcomes = list(await asyncio.gather(*tasks))
    return outcomes, time.perf_counter() - started
