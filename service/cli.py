"""`bert-serve` / `python -m service`: parse flags (each also a BERT_SERVE_* variable) and serve.

Bad settings, artifact directories or Hub models (--model-id) print one line and exit 2; a failure while loading in
the background stops the server with exit 1; SIGTERM/SIGINT drain in-flight work, then exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from artifact.embedding_dtypes import EMBEDDING_DTYPES
from artifact.errors import ArtifactError
from artifact.hub import HubError
from compile.errors import CompileError

from . import memory
from .settings import ENV_PREFIX, Settings


def _switch(text: str) -> bool:
    """A flag's value as TEI's command line takes it (`--auto-truncate false`), read as the settings
    read the same value from the environment."""
    try:
        return TypeAdapter(bool).validate_python(text)
    except ValidationError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


class _RefusedFlag(argparse.Action):
    """A TEI flag that means nothing here: one line saying what to use instead, exit 2."""

    def __init__(self, *args, instead: str, **kwargs):
        super().__init__(*args, help=f"refused: {instead}", **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string}: {self.instead}\n")


class _Granted(argparse.Action):
    """A TEI switch asking for what is so here anyway."""

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def build_parser() -> argparse.ArgumentParser:
    """The flags, each also a BERT_SERVE_* variable; docs/SERVE.md's reference is rendered from them."""
    parser = argparse.ArgumentParser(
        prog="bert-serve",
        description="Serve compiled BERT artifacts over HTTP (TEI- and OpenAI-compatible).",
        epilog=f"Every flag can also be set as an environment variable: --max-wait-ms -> {ENV_PREFIX}MAX_WAIT_MS.",
    )
    add = parser.add_argument
    add("--artifacts", action="append", type=Path,
        help="artifact directory; repeat to serve several models (requests pick one by `model`, "
             "else the first of the route's task; `/` serves the first)")
    add("--served-name", dest="served_names", action="append",
        help="the model's name in requests and GET /v1/models, one per --artifacts in order "
             "(default: the directory's name)")
    add("--model-id", help="a Hugging Face Hub model ORG/NAME to serve instead of --artifacts (env MODEL_ID, as TEI): "
        "compiled for this CPU on first start, /ready 503 meanwhile, then loaded from --artifact-cache")
    add("--revision", help="--model-id's branch, tag or commit (default main; env REVISION)")
    add("--hf-token", help="a token that can read a private or gated --model-id (default: HF_TOKEN)")
    add("--huggingface-hub-cache", type=Path, help="where Hub downloads are cached (default: HF_HUB_CACHE)")
    add("--artifact-cache", type=Path, help="where --model-id's compiled artifacts are kept, one per commit, CPU, "
        "config and version (default: $XDG_CACHE_HOME/bert-tvm-serve, else ~/.cache/bert-tvm-serve)")
    add("--config", type=Path, help="compile config (YAML) --model-id compiles with (default: configs/default.yaml)")
    add("--default-prompt-name", help="prepend this prompt of the checkpoint's sentence-transformers `prompts` to "
        "inputs that name none (e.g. query)")
    add("--default-prompt", help="prepend this text to inputs that name no prompt (e.g. 'query: ')")
    add("--host")
    add("--port", type=int)
    add("--grpc-port", type=int, help="also serve TEI's gRPC API (tei.v1) and /embed_multi's and /embed_hybrid's "
        "methods (bertserve.v1), with server reflection, on this port, sharing the models, batching, limits and "
        "API key (as `authorization: Bearer KEY` metadata)")
    add("--backend", choices=["tvm", "torch"], help="tvm (default) or torch eager on the same checkpoint")
    add("--cores", type=int, help="cores to use (default: the affinity mask capped by the cgroup CPU quota)")
    add("--workers", type=int, help="batches run side by side per model (default: tvm one per core, torch 1)")
    add("--threads-per-worker", type=int, help="intra-op threads of each worker (default: tvm 1, torch every core)")
    add("--wide-worker", action=argparse.BooleanOptionalAction, default=None,
        help="tvm: run a lone batch on every core while nothing else runs (default on)")
    add("--queue-ahead", action=argparse.BooleanOptionalAction, default=None,
        help="a busy worker holds the next batch and starts it as soon as it is done (default on)")
    add("--request-timeout", type=float, help="seconds a request may wait for its answer; beyond: 504 (default 60)")
    add("--max-batch-tokens", type=int, help="padded tokens per batch, bucket batch x seq (default 4096)")
    add("--max-batch-requests", type=int, help="inputs per batch (default: bucket bounds)")
    add("--max-wait-ms", type=float, help="most a batch waits for company, when arrivals are expected that soon (default 2)")
    add("--sort-window", type=int, help="batches' worth of queued inputs sorted by length (default 4)")
    add("--max-concurrent-requests", type=int, help="inputs queued or running; beyond: 429, or 413 for one request over it (default 512)")
    add("--max-client-batch-size", type=int, help="inputs per request; beyond: 413 (default 32)")
    add("--payload-limit", type=int, help="request body bytes; beyond: 413 (default 2000000)")
    add("--auto-truncate", nargs="?", const=True, type=_switch, metavar="true|false",
        help="HTTP requests that do not say `truncate` cut over-long inputs (default on, as TEI); off: 413")
    add("--no-auto-truncate", dest="auto_truncate", action="store_false", default=None, help="--auto-truncate false")
    add("--embedding-dtype", choices=EMBEDDING_DTYPES, help="what /embed, /v1/embeddings and gRPC Embed answer in "
        "where a request names no `embedding_dtype` (default float32): int8 / uint8 (the model's calibration "
        "ranges), binary / ubinary (signs packed 8 to a byte), as sentence-transformers' quantize_embeddings")
    # The rest of TEI's command line: its names for flags above, its flags, and those refused
    add("--hostname", dest="host", help="TEI's name for --host")
    add("-p", dest="port", type=int, help="--port")
    add("--served-model-name", dest="served_names", action="append", help="TEI's name for --served-name")
    add("--json-output", dest="log_format", action="store_const", const="json", help="--log-format json")
    add("--tokenization-workers", type=int, help="threads tokenizing large requests off the event loop (default 1)")
    add("--dtype", choices=["float32", "float16", "bfloat16"], help="with --model-id: what the compile's linears "
        "compute in (float32 or bfloat16 here; default: the fastest that keeps its accuracy gate); with --artifacts: "
        "refuse to start unless every model computes in this (chosen when compiling: bert-compile --precision)")
    add("--pooling", choices=["cls", "mean", "splade", "last-token"], help="with --model-id: how the compile pools "
        "(default: as the checkpoint says); with --artifacts: refuse to start unless every embedding model pools so "
        "(chosen when compiling: bert-compile --pooling)")
    add("--otlp-endpoint", help="export request traces (a span per request, with its tokenization, queue and "
        "inference) over OTLP/HTTP to this collector, e.g. http://collector:4318")
    add("--otlp-service-name", help="the traces' service.name (default bert-serve)")
    add("--cors-allow-origin", action="append", help="let browsers call from this origin (repeat for several, "
        "`*` for any); default: no CORS headers")
    add("--uds-path", type=Path, help="also serve HTTP on this unix socket")
    add("--prometheus-port", type=int, help="also serve the metrics on this port (/metrics stays on --port)")
    add("--disable-spans", nargs=0, action=_Granted, help="TEI's: log lines carry no trace spans here anyway")
    add("--dense-path", action=_RefusedFlag, instead="the Dense modules are compiled in: bert-compile takes those "
        "the checkpoint's modules.json lists")
    add("--device-id", action=_RefusedFlag, instead="a CUDA model runs on the first GPU it sees: pick it with "
        "CUDA_VISIBLE_DEVICES=ID")
    add("--api-key", help="require Authorization: Bearer KEY on every route but the probes and /metrics")
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add("--log-format", choices=["text", "json"])
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _settings_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn waits for in-flight requests before the app's shutdown runs; this tells the
        batchers at the signal itself, so inputs lingering for company are dispatched at once."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self._on_exit = on_exit

        def handle_exit(self, sig, frame) -> None:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to drain yet
                asyncio.get_running_loop().call_soon_threadsafe(self._on_exit)
            super().handle_exit(sig, frame)

    return DrainingServer


def serve_without_compiler() -> None:
    """Keep what only compiling needs out of a tvm-backend server: TVM's runtime library only (not
    its 250 MB compiler), and no torch. tvm_ffi imports torch whenever it is installed (for DLPack
    interop the server does not use); with `sys.modules["torch"] = None` that import fails as if
    torch were absent. `TVM_USE_RUNTIME_LIB=0` keeps the compiler library for a user who wants it."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]


def torch_installed() -> bool:
    """Whether PyTorch eager can run here (the torch backend imports both when it loads)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    memory.configure_allocator()  # before any thread exists (glibc fixes its arena count on the first)
    environ = dict(os.environ)  # before TVM's variables are set here: what a --model-id's compile runs in
    args = parse_args(argv)
    try:
        settings = Settings.load(vars(args))
    except ValidationError as exc:
        print(f"bert-serve: error: {_settings_error(exc)}", file=sys.stderr)
        return 2

    from . import logs

    logs.configure(settings.log_level, settings.log_format)
    if settings.backend == "tvm":
        serve_without_compiler()
    elif not torch_installed():
        print("bert-serve: error: --backend torch needs torch and transformers, which this environment lacks "
              "(a serving-only environment serves the tvm backend; install the project's `compile` extra)",
              file=sys.stderr)
        return 2
    import uvicorn  # heavy imports (tvm, torch) only once the settings are sane

    from .app import create_app
    from .grpc_api.server import GrpcPortTaken, check_grpc_port
    from .listeners import ListenerError, Listeners
    from .model_cache import CacheError, hub_artifact
    from .runtime import ArtifactSetError

    DrainingServer = _draining_server_class()
    from .topology import TopologyError

    server = None
    failed = False

    def stop_on_load_failure() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    try:
        pending = None
        if settings.model_id is not None:  # served as its artifact in the compile cache, compiled there if need be
            settings, pending = hub_artifact(settings, environ)
        if settings.grpc_port is not None:
            check_grpc_port(settings.host, settings.grpc_port)
        app = create_app(settings, on_fatal=stop_on_load_failure, pending=pending)
        listeners = Listeners(settings, app.state.metrics.registry)
    except (ArtifactError, ArtifactSetError, TopologyError, GrpcPortTaken, HubError, CacheError, CompileError,
            ListenerError) as exc:
        print(f"bert-serve: error: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            lifespan="on")
    server = DrainingServer(config, app.state.drain)
    # uvicorn drains, then re-raises the signal that stopped it; with these no-op handlers in place
    # (restored when it returns) a drained shutdown exits 0 instead of dying by that signal.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    try:
        server.run(sockets=listeners.sockets(config.bind_socket))
    finally:
        listeners.close()
    return 1 if failed or not server.started else 0
