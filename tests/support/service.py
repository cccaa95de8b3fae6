"""The service's answers as tests read them: error bodies, gRPC refusals, and refusals to start; the
clients of a running server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator


def error_of(response) -> tuple[str, str]:
    """(message, type) of an error answer, whose body must have its route's shape: TEI's
    `{"error", "error_type"}`, or OpenAI's `{"error": {"message", "type", "param", "code"}}` on OpenAI's routes."""
    path = response.request.url.path
    body = response.json()
    if path in ("/embeddings", "/models") or path.startswith(("/v1/", "/models/")):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]["message"], body["error"]["type"]
    assert set(body) == {"error", "error_type"}, body
    return body["error"], body["error_type"]


def server_refusal(artifacts: Path) -> list[str]:
    """Start `python -m service` on `artifacts`, which it must refuse before listening (exit 2):
    the lines it wrote to stderr."""
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(artifacts), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    return result.stderr.strip().splitlines()


def http_client(server) -> Iterator:
    """An httpx client on a running server (conftest's `serve`), closed after; a module fixture's body
    (`client = pytest.fixture(scope="module", name="client")(http_client)` beside the module's `server`)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def grpc_channel(server) -> Iterator:
    """A gRPC channel to a server started with `grpc=True`, closed after; a module fixture's body, as
    `http_client`."""
    import grpc

    with grpc.insecure_channel(server.grpc) as channel:
        yield channel


def assert_grpc_refuses(call: Callable, request, says: str = "", code: str = "INVALID_ARGUMENT") -> None:
    """`call(request)` fails with the status `code` and a detail that contains `says`."""
    import grpc
    import pytest

    with pytest.raises(grpc.RpcError) as refused:
        call(request)
    assert refused.value.code() == grpc.StatusCode[code] and says in refused.value.details(), refused.value
