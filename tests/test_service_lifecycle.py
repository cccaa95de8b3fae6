"""Readiness and load failure, with the app run in-process (a real uvicorn in a thread) so the test
controls the backend loader. Faults while serving: tests/test_service_faults.py."""

from __future__ import annotations

import gc
import threading

import httpx
import pytest

from loadtest.servers import running_app as running
from loadtest.servers import wait_until
from service.app import create_app
from service.backends import load_backend
from service.settings import Settings


def wait_ready(url: str) -> None:
    wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="/ready 200")


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


def test_what_startup_built_is_kept_out_of_full_collections_once_ready(tiny_embed_artifact):
    """A full garbage collection walks every tracked object (120-140 ms in a server with MiniLM
    loaded, in which every request in flight waits); once ready, the server has moved what startup
    built into the permanent generation, so full collections walk only what came after it."""
    gc.unfreeze()
    try:
        app = create_app(Settings(artifacts=[tiny_embed_artifact]))
        with running(app) as url:
            wait_ready(url)
            assert httpx.post(f"{url}/embed", json={"inputs": "after the freeze"}).status_code == 200
            frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
        assert frozen > 10 * walked, (frozen, walked)
    finally:
        gc.unfreeze()


def test_load_failure_is_reported_and_stops_the_server(tiny_embed_artifact):
    stopped = threading.Event()

    def broken_loader(directory, kind, threads):
        raise RuntimeError("library is corrupt")

    app = create_app(Settings(artifacts=[tiny_embed_artifact]), loader=broken_loader, on_fatal=stopped.set)
    with running(app) as url:
        assert stopped.wait(30)
        response = httpx.get(f"{url}/ready")
        assert response.status_code == 503 and "library is corrupt" in response.json()["error"]


def test_settings_refuse_no_artifacts_and_two_default_prompts():
    with pytest.raises(ValueError):
        Settings(artifacts=[])
    with pytest.raises(ValueError, match="not both"):
        Settings(artifacts=["a"], default_prompt_name="query", default_prompt="query: ")
