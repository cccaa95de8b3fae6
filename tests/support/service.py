"""The service's answers as tests read them: error bodies, and refusals to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
