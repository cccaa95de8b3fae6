"""`bert-serve` / `python -m service`: parse flags (each also a BERT_SERVE_* variable) and serve.

Bad settings or artifact directories print one line and exit 2; a failure while loading in
the background stops the server with exit 1; SIGTERM/SIGINT drain in-flight work, then exit 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from compile.errors import ArtifactError

from .settings import ENV_PREFIX, Settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bert-serve",
        description="Serve compiled BERT artifacts over HTTP (TEI- and OpenAI-compatible).",
        epilog=f"Every flag can also be set as an environment variable: --max-wait-ms -> {ENV_PREFIX}MAX_WAIT_MS.",
    )
    add = parser.add_argument
    add("--artifacts", action="append", type=Path,
        help="artifact directory; give twice to serve an embed and a classify artifact")
    add("--host")
    add("--port", type=int)
    add("--backend", choices=["tvm", "torch"], help="tvm (default) or torch eager on the same checkpoint")
    add("--workers", type=int, help="inference threads per model (default 2)")
    add("--torch-threads", type=int, help="torch.set_num_threads for --backend torch")
    add("--max-batch-tokens", type=int, help="padded tokens per batch, bucket batch x seq (default 16384)")
    add("--max-batch-requests", type=int, help="inputs per batch (default: bucket bounds)")
    add("--max-wait-ms", type=float, help="how long a lone input waits for a batch (default 2)")
    add("--sort-window", type=int, help="batches' worth of queued inputs sorted by length (default 4)")
    add("--max-concurrent-requests", type=int, help="inputs queued or running; beyond: 429 (default 512)")
    add("--max-client-batch-size", type=int, help="inputs per request; beyond: 413 (default 32)")
    add("--payload-limit", type=int, help="request body bytes; beyond: 413 (default 2000000)")
    add("--auto-truncate", action="store_true", default=None, help="truncate over-long inputs by default")
    add("--api-key", help="require Authorization: Bearer KEY on every route but /health")
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add("--log-format", choices=["text", "json"])
    return parser.parse_args(argv)


def _settings_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings.load(vars(args))
    except ValidationError as exc:
        print(f"bert-serve: error: {_settings_error(exc)}", file=sys.stderr)
        return 2

    from . import logs

    logs.configure(settings.log_level, settings.log_format)
    import uvicorn  # heavy imports (tvm, torch) only once the settings are sane

    from .app import create_app
    from .runtime import ArtifactSetError

    server: uvicorn.Server | None = None
    failed = False

    def stop_on_load_failure() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    try:
        app = create_app(settings, on_fatal=stop_on_load_failure)
    except (ArtifactError, ArtifactSetError) as exc:
        print(f"bert-serve: error: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                           access_log=False, lifespan="on"))
    # uvicorn drains, then re-raises the signal that stopped it; with these no-op handlers in place
    # (restored when it returns) a drained shutdown exits 0 instead of dying by that signal.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    server.run()
    return 1 if failed or not server.started else 0
