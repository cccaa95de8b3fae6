"""The FastAPI application: lifespan, error handlers and the ASGI middleware around the routes.

Middleware is plain ASGI (not BaseHTTPMiddleware) so it neither buffers responses nor breaks
cancellation. Outermost first: metrics and the request's trace span (with --otlp-endpoint; they
count every answer, refusals included), CORS (with --cors-allow-origin: a preflight needs no API key),
API key, body-size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from swagger_ui_bundle import swagger_ui_path

from .auth import bearer_key_matches
from .backends import load_backend
from .errors import InvalidInput, ServiceError, TooLarge, Unauthorized, error_body
from .grpc_api.server import start_grpc
from .metrics import Metrics
from .routes import router, with_body_schemas
from .runtime import BackendLoader, PendingArtifact, Runtime
from .settings import Settings

if TYPE_CHECKING:
    from .tracing import Tracing

log = logging.getLogger(__name__)

# Open to GET and HEAD without the API key, as TEI leaves them: the probes (an orchestrator sends no
# key; `/` and `/ping` are TEI's and SageMaker's) and Prometheus' scrape. POST / is guarded.
OPEN_PATHS = frozenset({"/health", "/ready", "/", "/ping", "/metrics"})
OPEN_METHODS = frozenset({"GET", "HEAD"})
DOCS_ASSETS = "/docs/assets"  # Swagger UI's scripts and styles, served from the installed package


def error_response(error: ServiceError, path: str) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if isinstance(error, Unauthorized) else None
    return JSONResponse(error.body(path), status_code=error.status, headers=headers)


class Answer:
    """`send` of one request, noting the status it is answered with (500 until a response starts)."""

    def __init__(self, send: Send):
        self._send, self.status = send, 500

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


class MetricsMiddleware:
    """Request count and latency per endpoint and status (unknown paths share one label) and, with
    --otlp-endpoint, the request's trace span, named by its route (`service.tracing`)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str], tracing: Tracing | None):
        self.app, self.metrics, self.paths, self.tracing = app, metrics, paths, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        answer = Answer(send)
        route = scope["path"] if scope["path"] in self.paths else None
        try:
            with contextlib.nullcontext() if self.tracing is None else self.tracing.request_span(scope, route, answer):
                await self.app(scope, receive, answer.send)
        finally:
            endpoint, status = route or "other", str(answer.status)
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.request_seconds.labels(endpoint, status).observe(time.perf_counter() - started)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but GET / HEAD of OPEN_PATHS, when a key is configured."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (scope["path"] in OPEN_PATHS and scope["method"] in OPEN_METHODS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not bearer_key_matches(given, self.api_key):
                refusal = error_response(Unauthorized("missing or wrong API key"), scope["path"])
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses bodies over the limit with 413, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(TooLarge(f"request body is larger than the limit of {self.limit} bytes"),
                                   scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _validation_message(exc: RequestValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _serve_docs(app: FastAPI) -> None:
    """Interactive API docs at /docs (Swagger UI), its assets from the package (no CDN: servers
    often have no internet)."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def create_app(settings: Settings, *, loader: BackendLoader = load_backend,
               on_fatal: Callable[[], None] | None = None, pending: PendingArtifact | None = None) -> FastAPI:
    """Build the app; the artifacts load (`pending`: are built, then load) in the background once the server runs."""
    metrics = Metrics()
    runtime = Runtime(settings, metrics, loader, on_fatal, pending)

    grpc, stopping = [], []  # the gRPC server once the lifespan started it; its stop once the signal came

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        loading = asyncio.create_task(runtime.start(), name="load-artifacts")
        if settings.grpc_port is not None:
            grpc.append(await start_grpc(settings, runtime, metrics))
        yield
        for grpc_server in grpc:  # in-flight calls finish (up to the request timeout), new ones are refused
            await grpc_server.stop(settings.request_timeout)
        if not loading.done():
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        await runtime.close()
        log.info("stopped")

    def drain() -> None:
        """The stop signal has come (uvicorn refuses new connections): gRPC refuses new calls, and
        every model dispatches what it holds or still receives without waiting for company."""
        stopping.extend(asyncio.get_running_loop().create_task(grpc_server.stop(settings.request_timeout))
                        for grpc_server in grpc)
        runtime.drain()

    app = FastAPI(title="bert-tvm-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings, app.state.metrics, app.state.runtime, app.state.drain = settings, metrics, runtime, drain
    # The routes join the app's own router: FastAPI 0.165's include_router wraps each included route
    # in layers (route contexts, body limits) that run on every request.
    app.router.routes.extend(router.routes)
    app.openapi = with_body_schemas(app.openapi)
    _serve_docs(app)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidInput(_validation_message(exc)), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, str(exc.detail), "Http"), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(ServiceError(f"internal error: {type(exc).__name__}"), request.url.path)

    app.add_middleware(BodyLimitMiddleware, limit=settings.payload_limit)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.cors_allow_origin:  # TEI's methods, and the API key's header
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origin, allow_methods=["GET", "POST"],
                           allow_headers=["content-type", "authorization"])
    app.add_middleware(MetricsMiddleware, metrics=metrics, paths=frozenset(route.path for route in router.routes),
                       tracing=runtime.tracing)
    return app
