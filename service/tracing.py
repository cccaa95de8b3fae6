"""OpenTelemetry traces (--otlp-endpoint): a server span per HTTP request (app.MetricsMiddleware)
and per gRPC call (grpc_api/server.py), with child spans for its tokenization, its wait in the queue and its inference, exported over
OTLP/HTTP by a background thread. Without an endpoint this module is not even imported: no
middleware, no spans, no exporter thread.

The stage spans are written once a request's results are in, from the times the batcher already
measures, so tracing adds nothing to the path of a batch. A W3C `traceparent` header on the
request makes its span a child of the caller's.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator, Protocol
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces on a collector
PROPAGATOR = TraceContextTextMapPropagator()


class Answered(Protocol):
    status: int  # the HTTP status the request was answered with


class Called(Protocol):
    code: object  # the grpc.StatusCode the call was answered with


# gRPC codes that are the server's fault (OpenTelemetry's RPC conventions mark a server span an error for these)
SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: a bare collector address (`http://collector:4318`) gets
    OTLP/HTTP's path; a URL with a path is used as given."""
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


class Tracing:
    """One app's tracer, exporting in batches to `endpoint` as `service_name`."""

    def __init__(self, endpoint: str, service_name: str):
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("bert-serve")

    @contextlib.contextmanager
    def request_span(self, scope: Scope, route: str | None, answer: Answered) -> Iterator[None]:
        """The span of one HTTP request, current while it runs: `METHOD /route` (the method alone
        for paths the app does not route), its status once `answer` has it, an error from 500 on."""
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        name = f"{scope['method']} {route}" if route else scope["method"]
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        with self.tracer.start_as_current_span(name, context=PROPAGATOR.extract(headers), kind=SpanKind.SERVER,
                                               attributes=attributes) as span:
            try:
                yield
            finally:
                span.set_attribute("http.response.status_code", answer.status)
                if answer.status >= 500:
                    span.set_status(StatusCode.ERROR)

    @contextlib.contextmanager
    def rpc_span(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None,
                 answer: Called) -> Iterator[None]:
        """The span of one gRPC call (a stream: the whole of it), current while it runs: `SERVICE/METHOD`
        (`tei.v1.Embed/Embed`), a child of a `traceparent` in its metadata, its status code once `answer`
        has it, an error for the codes a server's fault gives."""
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        service, name = method.rsplit("/", 1)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        with self.tracer.start_as_current_span(method, context=PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
                                               attributes=attributes) as span:
            try:
                yield
            finally:
                span.set_attribute("rpc.grpc.status_code", answer.code.value[0])
                if answer.code.name in SERVER_FAULTS:
                    span.set_status(StatusCode.ERROR)

    def record_stages(self, started: float, tokenized: float, results: Iterable, attributes: dict) -> None:
        """Child spans of the current request span (an HTTP request's or a gRPC call's), from
        `time.perf_counter` times: tokenization [started, tokenized], the queue until the request's
        first batch started, inference until its last batch ended (each result's queue and inference
        seconds count from its admission, right after tokenizing). Nothing where no request span is
        recording."""
        batches = {(tokenized + result.queue_seconds, tokenized + result.queue_seconds + result.inference_seconds)
                   for result in results}
        if not batches or not trace.get_current_span().is_recording():
            return
        first_start, last_end = min(start for start, _ in batches), max(end for _, end in batches)
        offset = time.time_ns() - time.perf_counter_ns()  # perf_counter seconds -> epoch nanoseconds

        def span(name: str, start: float, end: float, extra: dict | None = None) -> None:
            self.tracer.start_span(name, start_time=offset + int(start * 1e9), attributes=extra).end(
                end_time=offset + int(end * 1e9))

        span("tokenize", started, tokenized, attributes)
        span("queue", tokenized, first_start)
        span("inference", first_start, last_end, {"batches": len(batches)})

    def shutdown(self) -> None:
        """Export what is left, stop the exporter's thread."""
        self.provider.shutdown()
