"""Fault injection against a real uvicorn on 127.0.0.1: whatever raises where, every admitted input
is answered with a result or a JSON error, the admission count comes back to zero, and the server
neither hangs nor claims to be ready when it is not. The backend is the real tiny artifact wrapped
by `loadtest.faults.FaultyBackend`; synchronisation is by events and observed state, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

import service.batcher
import service.lanes
from artifact.costs import BatchCosts
from compile.bucketing import parse_buckets
from loadtest.faults import FaultyBackend
from loadtest.servers import metric_value, running_app, wait_until
from service.app import create_app
from service.backends import load_backend
from service.settings import Settings


def settings(artifact, **overrides) -> Settings:
    """One narrow worker, no lingering: each test decides what runs when."""
    values = {"artifacts": [artifact], "workers": 1, "threads_per_worker": 1, "wide_worker": False, "max_wait_ms": 0}
    return Settings(**{**values, **overrides})


@pytest.fixture
def faulty(tiny_embed_artifact):
    """Serve the tiny artifact through a FaultyBackend built from the keyword arguments (`costs`:
    batch costs to plan with; `settings`: overrides of `settings`)."""

    @contextlib.contextmanager
    def start(*, on_fatal=None, costs=None, **faults):
        backends: list[FaultyBackend] = []
        overrides = faults.pop("settings", {})

        def loader(directory, kind, threads):
            backends.append(FaultyBackend(load_backend(directory, kind, threads), **faults))
            if costs is not None:  # the batch costs the planner sees, instead of the measured ones
                backends[-1].costs = lambda: costs
            return backends[-1]

        app = create_app(settings(tiny_embed_artifact, **overrides), loader=loader, on_fatal=on_fatal)
        with running_app(app) as url:
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="/ready 200")
            yield url, backends[0]

    return start


def admitted(url: str) -> float:
    return metric_value(url, "bert_serve_admitted_inputs", model="tiny-embed")


def queued(url: str) -> float:
    return metric_value(url, "bert_serve_queue_depth", model="tiny-embed")


def post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(f"{url}/embed", json=body, timeout=60)))
    thread.start()
    return thread


def abandon(url: str, inputs: list[str]) -> None:
    """POST `inputs` to /embed and disconnect after 0.5 s, before they are answered."""

    async def impatient():
        async with httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/embed", json={"inputs": inputs}, timeout=0.5)

    asyncio.run(impatient())


def break_the_planner_once(monkeypatch) -> None:
    """The batch planner raises on its first call only: the batching loop dies once."""
    real_plan = service.batcher.plan_batches
    calls = {"n": 0}

    def plan_once_broken(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("planner bug")
        return real_plan(*args)

    monkeypatch.setattr(service.batcher, "plan_batches", plan_once_broken)


def test_a_failing_batch_fails_only_its_requests(faulty, tiny_embed_artifact):
    poison = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json")).token_to_id("poison")
    with faulty(poison_id=poison) as (url, backend):
        healthy = httpx.post(f"{url}/embed", json={"inputs": "healthy text"})
        assert healthy.status_code == 200
        failed = httpx.post(f"{url}/embed", json={"inputs": "poison"})
        assert failed.status_code == 500
        assert failed.json()["error_type"] == "Backend" and "call 2 failed" in failed.json()["error"]
        again = httpx.post(f"{url}/embed", json={"inputs": "healthy text"})
        np.testing.assert_allclose(again.json(), healthy.json(), atol=1e-6)
        assert metric_value(url, "bert_serve_batch_failures_total", model="tiny-embed") == 1
        assert admitted(url) == 0


def test_a_backend_returning_too_few_rows_answers_500_not_a_hang(faulty):
    with faulty(short_calls=[1]) as (url, backend):
        response = httpx.post(f"{url}/embed", json={"inputs": ["one", "two"]}, timeout=60)
        assert response.status_code == 500 and "shape" in response.json()["error"]
        assert httpx.post(f"{url}/embed", json={"inputs": ["one", "two"]}).status_code == 200
        assert admitted(url) == 0


@pytest.mark.parametrize("queue_ahead", [True, False])
def test_one_failing_input_drops_the_requests_other_queued_inputs(faulty, tiny_embed_artifact, queue_ahead):
    """Batches of one input; the first call blocks while a 3-input request queues behind it (its
    first input held by the worker, with queue-ahead); that input fails, so the other two are
    dropped, never run."""
    poison = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json")).token_to_id("poison")
    with faulty(block_calls=[1], poison_id=poison,
                settings={"max_batch_requests": 1, "queue_ahead": queue_ahead}) as (url, backend):
        first: list = []
        blocker = post_in_thread(url, {"inputs": "holds the only worker"}, first)
        assert backend.blocked.wait(60)
        second: list = []
        request = post_in_thread(url, {"inputs": ["poison", "never runs", "never runs either"]}, second)
        in_queue = 2 if queue_ahead else 3
        wait_until(lambda: queued(url) == in_queue and admitted(url) == 4, what=f"{in_queue} queued inputs")
        backend.release.set()
        blocker.join(60)
        request.join(60)
        assert first[0].status_code == 200
        assert second[0].status_code == 500 and second[0].json()["error_type"] == "Backend"
        wait_until(lambda: admitted(url) == 0, what="admission back to zero")
        assert backend.calls == 2  # the blocked call and the poisoned one; the other two were dropped


@pytest.mark.parametrize("queue_ahead", [True, False])
def test_a_request_past_its_deadline_gets_504_and_its_inputs_are_dropped(faulty, queue_ahead):
    """The late request waits in the queue, or (queue-ahead) as a batch held by the blocked worker,
    which skips it once its request is gone."""
    with faulty(block_calls=[1], settings={"request_timeout": 1.0, "queue_ahead": queue_ahead}) as (url, backend):
        first: list = []
        blocker = post_in_thread(url, {"inputs": "stuck"}, first)
        assert backend.blocked.wait(60)
        late = httpx.post(f"{url}/embed", json={"inputs": ["queued behind it", "and another"]}, timeout=60)
        assert late.status_code == 504 and late.json()["error_type"] == "Timeout"
        blocker.join(60)  # the stuck one times out too
        assert first[0].status_code == 504
        assert queued(url) == 0 and admitted(url) == 0  # the late request's inputs left the queue
        backend.release.set()
        assert httpx.post(f"{url}/embed", json={"inputs": "after"}, timeout=60).status_code == 200
        assert backend.calls == 2  # the late request never ran
        assert metric_value(url, "bert_serve_request_timeouts_total", model="tiny-embed") == 2


def test_a_request_that_can_never_fit_is_413_not_429(faulty):
    with faulty(settings={"max_concurrent_requests": 3, "max_client_batch_size": 8}) as (url, _):
        response = httpx.post(f"{url}/embed", json={"inputs": ["a", "b", "c", "d"]})
        assert response.status_code == 413 and "never fit" in response.json()["error"]
        assert httpx.post(f"{url}/embed", json={"inputs": ["a", "b", "c"]}).status_code == 200


def test_a_full_queue_answers_429_while_the_admitted_inputs_still_wait(faulty):
    """Room for 2 inputs, the worker blocked on the first, the second queued: further requests
    are refused at once (429), not queued, while those two are still unanswered."""
    with faulty(block_calls=[1], settings={"max_concurrent_requests": 2}) as (url, backend):
        answered: list = []
        threads = [post_in_thread(url, {"inputs": "stuck"}, answered)]
        assert backend.blocked.wait(60)
        threads.append(post_in_thread(url, {"inputs": "queued behind it"}, answered))
        wait_until(lambda: admitted(url) == 2, what="two inputs admitted")
        refused = [httpx.post(f"{url}/embed", json={"inputs": f"extra {i}"}, timeout=60) for i in range(5)]
        assert [response.status_code for response in refused] == [429] * 5
        assert answered == []  # the refusals came back while the admitted two still wait
        backend.release.set()
        for thread in threads:
            thread.join(60)
        assert [response.status_code for response in answered] == [200, 200]
        assert backend.calls == 2  # the refused requests never ran


def test_zero_shot_counts_texts_and_labels_against_the_client_batch_size(faulty):
    with faulty(settings={"max_client_batch_size": 4}) as (url, _):
        body = {"inputs": ["one text", "another"], "labels": ["x", "y", "z"]}
        response = httpx.post(f"{url}/classify", json=body)
        assert response.status_code == 413 and "5" in response.json()["error"]
        body["labels"] = ["x", "y"]
        assert httpx.post(f"{url}/classify", json=body).status_code == 200


def test_a_dead_batching_loop_answers_503_and_restarts(faulty, monkeypatch):
    break_the_planner_once(monkeypatch)
    with faulty() as (url, _):
        response = httpx.post(f"{url}/embed", json={"inputs": ["a", "b"]}, timeout=60)
        assert response.status_code == 503 and "planner bug" in response.json()["error"]
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="the loop restarted")
        assert httpx.post(f"{url}/embed", json={"inputs": "after the restart"}, timeout=60).status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 200
        assert metric_value(url, "bert_serve_batcher_crashes_total", model="tiny-embed") == 1
        assert admitted(url) == 0


def test_a_worker_refusing_a_batch_fails_that_batch_and_frees_the_worker(faulty, monkeypatch):
    """The batch starts on its worker from the batching loop; a refusal there (the worker's executor
    shut down) is the batch's error: its request gets a JSON 500, the loop and the worker go on."""
    real_submit = service.lanes.Lane.submit
    calls = {"n": 0}

    def refuse_once(lane, fn, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return real_submit(lane, fn, *args)

    with faulty() as (url, _):
        monkeypatch.setattr(service.lanes.Lane, "submit", refuse_once)
        refused = httpx.post(f"{url}/embed", json={"inputs": "refused"}, timeout=60)
        assert refused.status_code == 500 and "after shutdown" in refused.json()["error"]
        assert httpx.post(f"{url}/embed", json={"inputs": "served"}, timeout=60).status_code == 200
        assert metric_value(url, "bert_serve_batcher_crashes_total", model="tiny-embed") == 0
        assert admitted(url) == 0


def test_a_loop_that_keeps_dying_turns_ready_503_and_stops_the_server(faulty, monkeypatch):
    def broken(*args):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(service.batcher, "plan_batches", broken)
    stopped = threading.Event()
    with faulty(on_fatal=stopped.set) as (url, _):
        statuses = []
        for i in range(service.batcher.MAX_LOOP_CRASHES):
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="the loop restarted")
            statuses.append(httpx.post(f"{url}/embed", json={"inputs": f"try {i}"}, timeout=60).status_code)
        assert statuses == [503] * len(statuses)
        assert stopped.wait(30)
        assert httpx.post(f"{url}/embed", json={"inputs": "after"}, timeout=60).status_code == 503
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "failed 3 times" in ready.json()["error"]


def test_a_warmup_failure_on_one_worker_ends_start_up(tiny_embed_artifact):
    """Two workers and the wide one warm up in parallel; the second warm-up fails: start-up stops
    with that error (there is no barrier for the others to wait on)."""
    stopped = threading.Event()

    def loader(directory, kind, threads):
        return FaultyBackend(load_backend(directory, kind, threads), fail_warmups=[2])

    app = create_app(Settings(artifacts=[tiny_embed_artifact], cores=2, workers=2, threads_per_worker=1),
                     loader=loader, on_fatal=stopped.set)
    with running_app(app) as url:
        assert stopped.wait(60)
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "warm-up 2 failed" in ready.json()["error"]


def test_admission_returns_to_zero_when_clients_give_up(faulty):
    """Clients that disconnect while their inputs wait behind a blocked call leave nothing admitted."""
    with faulty(block_calls=[1]) as (url, backend):
        first: list = []
        blocker = post_in_thread(url, {"inputs": "blocks"}, first)
        assert backend.blocked.wait(60)
        abandon(url, ["x", "y"])
        backend.release.set()
        blocker.join(60)
        wait_until(lambda: admitted(url) == 0, what="admission back to zero")
        assert first[0].status_code == 200


def test_a_lone_request_on_an_idle_server_does_not_wait_for_company(faulty):
    """--max-wait-ms is only spent when arrivals are expected: nothing has arrived for a while."""
    with faulty(settings={"max_wait_ms": 30000}) as (url, _):
        response = httpx.post(f"{url}/embed", json={"inputs": "alone"}, timeout=60)
        assert response.status_code == 200 and int(response.headers["x-queue-time"]) < 15000  # not the 30 s wait


def test_inputs_the_planner_would_not_batch_further_do_not_wait_for_company(faulty):
    """Costs under which two 2-row calls beat one 4-row call: 4-input requests run as 2 + 2, and
    the second pair is a full batch. Concurrent clients make company expected, but no pair waits
    the 30 s for more (the last request's second pair used to, with nothing left to come)."""
    buckets = parse_buckets("1x8,2x16,4x16")
    two_rows_pay = BatchCosts(buckets, dict(zip(buckets, (0.06, 0.087, 0.215))), lambda size, seq: 1.0)
    with faulty(costs=two_rows_pay, settings={"max_wait_ms": 30000}) as (url, _):
        body = {"inputs": [f"text {i}" for i in range(4)]}
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda _: httpx.post(f"{url}/embed", json=body, timeout=60), range(16)))
        assert {response.status_code for response in responses} == {200}
        assert max(int(response.headers["x-queue-time"]) for response in responses) < 10000  # not 30 s


def test_a_client_sending_back_to_back_does_not_wait_for_company(faulty):
    """Its requests arrive at a high rate, but each only after the last is answered: none finds
    company, so none lingers for a next one that cannot come before it is answered."""
    with faulty(settings={"max_wait_ms": 5000}) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for i in range(12):
            response = client.post("/embed", json={"inputs": f"query {i}"})
            assert response.status_code == 200 and int(response.headers["x-queue-time"]) < 2500  # not the 5 s wait


def test_while_the_loop_restarts_requests_and_ready_get_503(faulty, monkeypatch):
    """Between a death of the batching loop and its restart, new requests and /ready answer 503
    (the restart waits RESTART_BACKOFF_S; here longer than the test)."""
    break_the_planner_once(monkeypatch)
    monkeypatch.setattr(service.batcher, "RESTART_BACKOFF_S", 3600.0)
    with faulty() as (url, _):
        assert httpx.post(f"{url}/embed", json={"inputs": "crashes the loop"}, timeout=60).status_code == 503
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "restarting" in ready.json()["error"]
        meanwhile = httpx.post(f"{url}/embed", json={"inputs": "while it restarts"}, timeout=60)
        assert meanwhile.status_code == 503 and "restarting" in meanwhile.json()["error"]
        assert metric_value(url, "bert_serve_batcher_crashes_total", model="tiny-embed") == 1
        assert admitted(url) == 0


def test_the_ray_health_check_fails_once_a_batcher_has_given_up(tiny_embed_artifact, monkeypatch):
    """Serve replaces a replica whose check_health raises: it must raise once the loop gave up,
    not wait for a readiness that cannot come."""
    from service.ray_serve import BertServer

    def broken(*args):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(service.batcher, "plan_batches", broken)
    stopped = threading.Event()
    app = create_app(settings(tiny_embed_artifact), on_fatal=stopped.set)
    replica = types.SimpleNamespace(runtime=app.state.runtime)  # check_health reads only the runtime
    check_health = BertServer.func_or_class.check_health
    with running_app(app) as url:
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="/ready 200")
        asyncio.run(asyncio.wait_for(check_health(replica), 30))  # healthy: returns
        for i in range(service.batcher.MAX_LOOP_CRASHES):
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="the loop restarted")
            assert httpx.post(f"{url}/embed", json={"inputs": f"try {i}"}, timeout=60).status_code == 503
        assert stopped.wait(30)
        with pytest.raises(RuntimeError, match="failed 3 times"):
            asyncio.run(asyncio.wait_for(check_health(replica), 30))


@pytest.mark.parametrize("queue_ahead", [True, False])
def test_a_disconnected_clients_queued_inputs_never_run(faulty, tiny_embed_artifact, queue_ahead):
    """A client whose 2-input request waits behind a blocked call disconnects: its inputs leave
    the queue (or the batch the busy worker holds, with queue-ahead) before they run, counted in
    bert_serve_dropped_inputs_total, and the clients that wait are served. Its inputs are
    poisoned: had either run, its batch would have failed."""
    poison = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json")).token_to_id("poison")
    with faulty(block_calls=[1], poison_id=poison, settings={"queue_ahead": queue_ahead}) as (url, backend):
        first: list = []
        blocker = post_in_thread(url, {"inputs": "holds the only worker"}, first)
        assert backend.blocked.wait(60)
        abandon(url, ["poison", "poison again"])
        wait_until(lambda: admitted(url) == 1 and queued(url) == 0, what="the abandoned request dropped")
        backend.release.set()
        blocker.join(60)
        assert first[0].status_code == 200
        assert httpx.post(f"{url}/embed", json={"inputs": "a client that waits"}, timeout=60).status_code == 200
        wait_until(lambda: metric_value(url, "bert_serve_dropped_inputs_total", model="tiny-embed") == 2,
                   what="two dropped inputs counted")
        assert backend.calls == 2  # the blocked call and the waiting client's; the abandoned inputs never ran
        assert metric_value(url, "bert_serve_batch_failures_total", model="tiny-embed") == 0
