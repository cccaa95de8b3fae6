"""Readiness, load failure and a failing batch, with the app run in-process (uvicorn in a thread)
so the test controls the backend loader."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn

from service.app import create_app
from service.backends import load_backend
from service.settings import Settings


@contextlib.contextmanager
def running(app):
    """uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL once it listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.05)


def test_ready_is_503_until_warmed_up(tiny_embed_artifact):
    release = threading.Event()

    def slow_loader(directory, kind, threads):
        assert release.wait(60)
        return load_backend(directory, kind, threads)

    app = create_app(Settings(artifacts=[tiny_embed_artifact]), loader=slow_loader)
    with running(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        response = httpx.get(f"{url}/ready")
        assert response.status_code == 503 and response.json()["error_type"] == "Unhealthy"
        response = httpx.post(f"{url}/embed", json={"inputs": "too early"})
        assert response.status_code == 503 and set(response.json()) == {"error", "error_type"}
        assert httpx.get(f"{url}/info").json()["ready"] is False
        release.set()
        wait_ready(url)
        assert httpx.post(f"{url}/embed", json={"inputs": "on time"}).status_code == 200


def test_load_failure_is_reported_and_stops_the_server(tiny_embed_artifact):
    stopped = threading.Event()

    def broken_loader(directory, kind, threads):
        raise RuntimeError("library is corrupt")

    app = create_app(Settings(artifacts=[tiny_embed_artifact]), loader=broken_loader, on_fatal=stopped.set)
    with running(app) as url:
        assert stopped.wait(30)
        response = httpx.get(f"{url}/ready")
        assert response.status_code == 503 and "library is corrupt" in response.json()["error"]


class PoisonedBackend:
    """The real backend, except that a batch holding the token `poison` raises."""

    def __init__(self, backend, poison_id: int):
        self._backend, self._poison_id = backend, poison_id

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def run(self, input_ids, attention_mask, token_type_ids):
        if (input_ids == self._poison_id).any():
            raise RuntimeError("kernel exploded")
        return self._backend.run(input_ids, attention_mask, token_type_ids)


def test_a_failing_batch_fails_only_its_requests(tiny_embed_artifact):
    from tokenizers import Tokenizer

    poison_id = Tokenizer.from_file(str(tiny_embed_artifact / "tokenizer" / "tokenizer.json")).token_to_id("poison")

    def loader(directory, kind, threads):
        return PoisonedBackend(load_backend(directory, kind, threads), poison_id)

    app = create_app(Settings(artifacts=[tiny_embed_artifact], max_wait_ms=0), loader=loader)
    with running(app) as url:
        wait_ready(url)
        healthy = httpx.post(f"{url}/embed", json={"inputs": "healthy text"})
        assert healthy.status_code == 200
        failed = httpx.post(f"{url}/embed", json={"inputs": "poison"})
        assert failed.status_code == 500
        assert failed.json()["error_type"] == "Backend" and "kernel exploded" in failed.json()["error"]
        again = httpx.post(f"{url}/embed", json={"inputs": "healthy text"})
        assert again.status_code == 200
        np.testing.assert_allclose(again.json(), healthy.json(), atol=1e-6)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'bert_serve_batch_failures_total{model="embed"} 1.0' in metrics


@pytest.mark.parametrize("artifacts", [[], ["a", "b", "c"]])
def test_settings_refuse_no_or_too_many_artifacts(artifacts):
    with pytest.raises(ValueError):
        Settings(artifacts=artifacts)
