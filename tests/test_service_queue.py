"""The batcher's queue, timeouts and drain, in-process and without a worker (the HTTP behaviour
around them is tests/test_service_faults.py's)."""

from __future__ import annotations

import asyncio
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest
from packaging.specifiers import SpecifierSet

from compile.bucketing import parse_buckets
from service.admission import InputQueue
from service.batcher import Batcher
from service.errors import GatewayTimeout
from service.metrics import Metrics
from service.planning import BatchLimits
from service.runtime import Runtime
from service.settings import Settings
from service.tokenization import Encoded

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def encoded(length: int) -> Encoded:
    return Encoded(np.arange(length, dtype=np.int64), np.zeros(length, dtype=np.int64))


def test_a_finished_requests_queued_inputs_leave_the_queue_at_once():
    """A request that times out or is abandoned takes its queued inputs out of the queue then,
    not when the batcher next takes from it; inputs already taken into a batch are not counted."""

    async def scenario():
        queue = InputQueue(8)
        abandoned, waiting = queue.admit([encoded(3), encoded(4)]), queue.admit([encoded(5)])
        assert len(queue) == 3
        assert queue.release(abandoned) == 2
        assert list(queue.entries) == waiting and queue.admitted == 1
        assert queue.take(4) == waiting
        assert queue.release(waiting) == 0 and len(queue) == 0 and queue.admitted == 0

    asyncio.run(scenario())


def test_pyproject_admits_only_pythons_whose_wait_for_raises_the_builtin_timeout():
    """service/ catches the built-in TimeoutError around asyncio.wait_for: on 3.10 wait_for raised
    asyncio.TimeoutError, another class (a linger timeout crashed the batching loop, a deadline
    gave 500), so the package requires 3.11."""
    requires = SpecifierSet(tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"])
    assert "3.10.14" not in requires and "3.11.0" in requires
    assert asyncio.TimeoutError is TimeoutError


def test_the_linger_and_deadline_paths_take_asyncio_timeout_error(monkeypatch):
    """With wait_for raising asyncio.TimeoutError: a request past its deadline is a 504 whose
    input left the queue, and a linger that times out ends the wait (it is not a crash)."""

    async def timing_out(awaitable, timeout):
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        else:
            awaitable.cancel()
        raise asyncio.TimeoutError

    async def scenario():
        batcher = Batcher("tiny", types.SimpleNamespace(buckets=parse_buckets("1x8,4x16")),
                          BatchLimits(16384, None, 16), lanes=None, max_wait_ms=60_000, sort_window=4, capacity=8,
                          request_timeout_s=60, metrics=Metrics())
        monkeypatch.setattr(asyncio, "wait_for", timing_out)
        with pytest.raises(GatewayTimeout):
            await batcher.submit([encoded(3)])
        assert len(batcher.queue) == 0 and batcher.queue.admitted == 0
        batcher.queue.admit([encoded(3)])
        monkeypatch.setattr(batcher, "_lingering_pays", lambda: True)
        await batcher._linger()

    asyncio.run(scenario())


def test_shutdown_drains_every_model_at_once_against_one_deadline(tiny_embed_artifact):
    """Every model's batcher drains at the same time, all by the request timeout from the start of
    shutdown (one after another, each with its own, outlasted Kubernetes' grace period)."""
    runtime = Runtime(Settings(artifacts=[tiny_embed_artifact], request_timeout=30), Metrics())
    deadlines: list[float] = []
    both_draining = asyncio.Event()

    class Draining:
        async def close(self, deadline: float) -> bool:
            deadlines.append(deadline)
            if len(deadlines) == 2:
                both_draining.set()
            await both_draining.wait()  # finishes only once the other model drains too
            return True

    runtime.models = {name: types.SimpleNamespace(batcher=Draining()) for name in ("first", "second")}

    async def scenario():
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(runtime.close(), 30)
        assert deadlines[0] == deadlines[1] and started + 30 <= deadlines[0] <= asyncio.get_running_loop().time() + 30

    asyncio.run(scenario())
