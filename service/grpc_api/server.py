"""TEI's gRPC API (`tei.v1`, tei.proto) beside the HTTP server, and our own retrieval methods
(`bertserve.v1`, retrieval.proto: /embed_multi and /embed_hybrid): the same models, batchers, limits,
API key and metrics, on the same event loop.

Each RPC is one input (the streaming RPCs: one per message, run concurrently so that they batch
together, answered in order). Errors carry TEI's status codes for its error types; with an API key
every method of both packages wants `authorization: Bearer KEY` metadata (reflection stays open, so clients
can discover the API). A client that cancels a call cancels the handler's task, so its queued
input leaves the batcher's queue like an HTTP request whose client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_reflection.v1alpha import reflection

from artifact.embedding_dtypes import quantize

from ..auth import bearer_key_matches
from ..errors import InvalidInput, ServiceError, Unauthorized
from ..inference import Computed
from ..inputs import (
    Truncation,
    hybrid_outputs,
    known_embedding_dtype,
    non_empty,
    sequence,
    token_vector_dtype,
    truncation,
)
from ..metrics import Metrics
from ..runtime import Runtime, model_kind
from ..settings import Settings
from . import retrieval_pb2 as rpb
from . import retrieval_pb2_grpc as rpb_grpc
from . import tei_pb2 as pb
from . import tei_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ..tracing import Tracing

log = logging.getLogger(__name__)

# TEI's mapping of its error types to gRPC status codes (ours add Timeout, Unauthorized, NotFound)
STATUS_OF_ERROR_TYPE = {
    "Validation": grpc.StatusCode.INVALID_ARGUMENT,
    "Empty": grpc.StatusCode.INVALID_ARGUMENT,
    "Tokenizer": grpc.StatusCode.FAILED_PRECONDITION,
    "Overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Unhealthy": grpc.StatusCode.UNAVAILABLE,
    "Backend": grpc.StatusCode.INTERNAL,
    "Timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "Unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    "NotFound": grpc.StatusCode.NOT_FOUND,
}
MODEL_TYPES = {"classify": pb.MODEL_TYPE_CLASSIFIER, "rerank": pb.MODEL_TYPE_RERANKER}
# each package's generated modules and its services, all served by one servicer
SERVICES = ((pb, pb_grpc, ("Info", "Embed", "Predict", "Rerank", "Tokenize")),
            (rpb, rpb_grpc, ("EmbedMulti", "EmbedHybrid")))
SERVICE_NAMES = tuple(messages.DESCRIPTOR.services_by_name[name].full_name
                      for messages, _, names in SERVICES for name in names)
# the API key guards both packages' methods; reflection stays open
GUARDED_PREFIXES = tuple(f"/{messages.DESCRIPTOR.package}." for messages, _, _ in SERVICES)
# each method's service, by the method's name (unique across them): a call's span is `tei.v1.Embed/Embed`
SERVICE_OF_METHOD = {method.name: service.full_name for messages, _, _ in SERVICES
                     for service in messages.DESCRIPTOR.services_by_name.values() for method in service.methods}


@dataclass
class _Answer:
    code: grpc.StatusCode = grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def _answering(metrics: Metrics, tracing: Tracing | None, method: str, context):
    """Around one call: its trace span (with --otlp-endpoint: `service.tracing`), count it in the HTTP
    request metrics (endpoint `grpc METHOD`, status its code) and turn a failure into its status code
    (a ServiceError's by TEI's mapping)."""
    started, answer = time.perf_counter(), _Answer()
    span = (contextlib.nullcontext() if tracing is None else
            tracing.rpc_span(f"{SERVICE_OF_METHOD[method]}/{method}", context.invocation_metadata(), answer))
    with span:
        try:
            yield
        except asyncio.CancelledError:  # the client cancelled: the task (and its queued inputs) go
            answer.code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            if isinstance(exc, ServiceError):
                answer.code, message = STATUS_OF_ERROR_TYPE.get(exc.error_type, grpc.StatusCode.INTERNAL), exc.message
            else:
                log.exception("gRPC %s failed", method)
                answer.code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
            await context.abort(answer.code, message)
        finally:
            metrics.requests.labels(f"grpc {method}", answer.code.name).inc()
            metrics.request_seconds.labels(f"grpc {method}", answer.code.name).observe(time.perf_counter() - started)


def _recorded(handler, streams: bool = False):
    """`handler` answering within `_answering`: a unary one returns its answer, a streaming one
    (`streams`) yields them."""
    if streams:
        @functools.wraps(handler)
        async def streaming(self, requests, context):
            async with _answering(self.metrics, self.runtime.tracing, handler.__name__, context):
                async for answer in handler(self, requests, context):
                    yield answer
        return streaming

    @functools.wraps(handler)
    async def unary(self, request, context):
        async with _answering(self.metrics, self.runtime.tracing, handler.__name__, context):
            return await handler(self, request, context)
    return unary


def _rpc(name: str, answer: str, streams: bool = False):
    """The tei.v1 method `name`: its one message answered by the servicer's `answer` method, or
    (`streams`) each message of a stream, concurrently and in order."""
    if streams:
        async def method(self, requests, context):
            async for reply in _in_order(requests, getattr(self, answer)):
                yield reply
    else:
        async def method(self, request, context):
            return await getattr(self, answer)(request)
    method.__name__ = method.__qualname__ = name
    return _recorded(method, streams)


async def _in_order(requests, answer):
    """Answer a stream's messages concurrently (they join the same batches), yielding in order."""
    pending: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        async for request in requests:
            await pending.put(asyncio.ensure_future(answer(request)))
        await pending.put(None)

    reader = asyncio.ensure_future(read())
    try:
        while True:
            getting = asyncio.ensure_future(pending.get())
            await asyncio.wait({getting, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():  # the reader failed (or ended) before queuing anything more
                getting.cancel()
                reader.result()
                getting = asyncio.ensure_future(pending.get())
            task = await getting
            if task is None:
                return
            yield await task
    finally:
        reader.cancel()
        while not pending.empty():
            task = pending.get_nowait()
            if task is not None:
                task.cancel()


def _metadata(computed: Computed, started: float) -> pb.Metadata:
    return pb.Metadata(compute_chars=computed.characters, compute_tokens=computed.tokens,
                       total_time_ns=int((time.perf_counter() - started) * 1e9),
                       tokenization_time_ns=int(computed.tokenization_seconds * 1e9),
                       queue_time_ns=int(computed.queue_seconds * 1e9),
                       inference_time_ns=int(computed.inference_seconds * 1e9))


def _text(value: str) -> str:
    """A message's one text (`inputs`), which may not be empty."""
    return non_empty(value, field="inputs")


def _prompt(request) -> str | None:
    return request.prompt_name if request.HasField("prompt_name") else None


def _model(request) -> str | None:
    """bertserve.v1's `model`, as HTTP's: unset, the first model serving the method's task."""
    return request.model if request.HasField("model") else None


class Servicer(pb_grpc.InfoServicer, pb_grpc.EmbedServicer, pb_grpc.PredictServicer, pb_grpc.RerankServicer,
               pb_grpc.TokenizeServicer, rpb_grpc.EmbedMultiServicer, rpb_grpc.EmbedHybridServicer):
    """Every tei.v1 and bertserve.v1 RPC (their names are unique across the services), over the HTTP
    routes' runtime."""

    def __init__(self, runtime: Runtime, metrics: Metrics):
        self.runtime, self.metrics = runtime, metrics

    def _truncation(self, request) -> Truncation:
        """Where `request`'s over-long inputs lose tokens (its `truncation_direction`), or None: refused.
        Only where the request sets `truncate`: TEI's gRPC ignores --auto-truncate (`inputs.truncation`)."""
        return truncation(request.truncate,
                          "left" if request.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT else "right")

    @_recorded
    async def Info(self, request, context):
        described = self.runtime.describe()
        max_batch_requests = described["max_batch_requests"]
        return pb.InfoResponse(
            version=described["version"], model_id=described["model_id"],
            model_sha=described["model_sha"], model_dtype=described["model_dtype"],
            model_type=MODEL_TYPES.get(model_kind(self.runtime.primary.manifest), pb.MODEL_TYPE_EMBEDDING),
            max_concurrent_requests=described["max_concurrent_requests"],
            max_input_length=described["max_input_length"] or 0, max_batch_tokens=described["max_batch_tokens"],
            max_client_batch_size=described["max_client_batch_size"],
            tokenization_workers=described["tokenization_workers"],
            **({"max_batch_requests": max_batch_requests} if max_batch_requests is not None else {}))

    async def _embed(self, request) -> pb.EmbedResponse:
        started = time.perf_counter()
        service = self.runtime.model("embed")
        normalize = request.normalize if request.HasField("normalize") else True  # TEI's default
        dimensions = request.dimensions if request.HasField("dimensions") else None
        dtype = self._embedding_dtype(request)
        vectors, computed = await service.embed([_text(request.inputs)], normalize, self._truncation(request),
                                                dimensions, prompt_name=_prompt(request), embedding_dtype=dtype)
        return pb.EmbedResponse(embeddings=vectors[0], metadata=_metadata(computed, started),
                                **({"embedding_dtype": dtype} if dtype != "float32" else {}))

    def _embedding_dtype(self, request) -> str:
        """The request's `embedding_dtype` (not TEI's field), else the server's --embedding-dtype."""
        if not request.HasField("embedding_dtype"):
            return self.runtime.settings.embedding_dtype
        return known_embedding_dtype(request.embedding_dtype)

    async def _embed_multi(self, request) -> rpb.EmbedMultiResponse:
        """/embed_multi's answer for one input: its token vectors, float32 unless `embedding_dtype` says."""
        started = time.perf_counter()
        service = self.runtime.model("embed_multi", _model(request))
        dtype = token_vector_dtype(request.embedding_dtype if request.HasField("embedding_dtype") else "float32")
        is_query = request.is_query if request.HasField("is_query") else True  # HTTP's default
        vectors, computed = await service.embed_multi([_text(request.inputs)], is_query, self._truncation(request))
        return rpb.EmbedMultiResponse(
            token_embeddings=[pb.TokenEmbedding(embeddings=row) for row in quantize(vectors[0], dtype)],
            metadata=_metadata(computed, started), **({"embedding_dtype": dtype} if dtype != "float32" else {}))

    async def _embed_hybrid(self, request) -> rpb.EmbedHybridResponse:
        """/embed_hybrid's answer for one input: the `outputs` asked for (none named: all three)."""
        started = time.perf_counter()
        service = self.runtime.model("embed_hybrid", _model(request))
        outputs = hybrid_outputs(request.outputs)
        normalize = request.normalize if request.HasField("normalize") else True
        answers, computed = await service.embed_hybrid([_text(request.inputs)], outputs, normalize,
                                                       self._truncation(request), _prompt(request))
        answer = answers[0]
        return rpb.EmbedHybridResponse(
            dense=answer.get("dense", ()), sparse=[pb.SparseValue(**pair) for pair in answer.get("sparse", ())],
            colbert=[pb.TokenEmbedding(embeddings=row) for row in answer.get("colbert", ())],
            metadata=_metadata(computed, started))

    async def _embed_sparse(self, request) -> pb.EmbedSparseResponse:
        started = time.perf_counter()
        service = self.runtime.model("embed_sparse")
        pairs, computed = await service.embed_sparse([_text(request.inputs)], self._truncation(request),
                                                     _prompt(request))
        return pb.EmbedSparseResponse(sparse_embeddings=[pb.SparseValue(**pair) for pair in pairs[0]],
                                      metadata=_metadata(computed, started))

    async def _embed_all(self, request) -> pb.EmbedAllResponse:
        started = time.perf_counter()
        service = self.runtime.model("embed_all")
        states, computed = await service.embed_all([_text(request.inputs)], self._truncation(request),
                                                   _prompt(request))
        return pb.EmbedAllResponse(token_embeddings=[pb.TokenEmbedding(embeddings=row) for row in states[0]],
                                   metadata=_metadata(computed, started))

    async def _predict(self, request) -> pb.PredictResponse:
        started = time.perf_counter()
        text = sequence(request.inputs) if isinstance(request, pb.PredictPairRequest) else _text(request.inputs)
        service = self.runtime.model("classify")
        predictions, computed = await service.classify([text], "none" if request.raw_scores else "auto",
                                                       self._truncation(request))
        return pb.PredictResponse(predictions=[pb.Prediction(**prediction) for prediction in predictions[0]],
                                  metadata=_metadata(computed, started))

    async def _rerank(self, query: str, texts: list[str], options) -> pb.RerankResponse:
        """Rank `texts` against `query` as `options` (a RerankRequest, or a stream's first message) say."""
        started = time.perf_counter()
        service = self.runtime.model("rerank")
        service.check_batch_size(len(texts))
        ranks, computed = await service.rerank(query, texts, options.raw_scores, self._truncation(options),
                                               options.return_text)
        return pb.RerankResponse(ranks=[pb.Rank(**rank) for rank in ranks], metadata=_metadata(computed, started))

    async def _tokenize(self, request) -> pb.EncodeResponse:
        service = self.runtime.model(None)
        tokens = (await service.tokens([_text(request.inputs)], request.add_special_tokens, _prompt(request)))[0]
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**{k: v for k, v in token.items() if v is not None})
                                         for token in tokens])

    async def _decode(self, request) -> pb.DecodeResponse:
        ids = non_empty(list(request.ids), field="ids")
        service = self.runtime.model(None)
        return pb.DecodeResponse(text=(await service.decode([ids], request.skip_special_tokens))[0])

    async def _rerank_request(self, request) -> pb.RerankResponse:
        return await self._rerank(request.query, list(request.texts), request)

    @_recorded
    async def RerankStream(self, requests, context):
        """One (query, text) pair per message, ranked together; options from the first message."""
        pairs = [request async for request in requests]
        if not pairs:
            raise InvalidInput("the stream held no (query, text) pair")
        first = pairs[0]
        if any(pair.query != first.query for pair in pairs):
            raise InvalidInput("every message of a RerankStream must carry the same query")
        return await self._rerank(first.query, [pair.text for pair in pairs], first)

    Embed = _rpc("Embed", "_embed")
    EmbedStream = _rpc("EmbedStream", "_embed", streams=True)
    EmbedSparse = _rpc("EmbedSparse", "_embed_sparse")
    EmbedSparseStream = _rpc("EmbedSparseStream", "_embed_sparse", streams=True)
    EmbedAll = _rpc("EmbedAll", "_embed_all")
    EmbedAllStream = _rpc("EmbedAllStream", "_embed_all", streams=True)
    Predict = _rpc("Predict", "_predict")
    PredictStream = _rpc("PredictStream", "_predict", streams=True)
    PredictPair = _rpc("PredictPair", "_predict")
    PredictPairStream = _rpc("PredictPairStream", "_predict", streams=True)
    Rerank = _rpc("Rerank", "_rerank_request")
    Tokenize = _rpc("Tokenize", "_tokenize")
    TokenizeStream = _rpc("TokenizeStream", "_tokenize", streams=True)
    Decode = _rpc("Decode", "_decode")
    DecodeStream = _rpc("DecodeStream", "_decode", streams=True)
    EmbedMulti = _rpc("EmbedMulti", "_embed_multi")
    EmbedMultiStream = _rpc("EmbedMultiStream", "_embed_multi", streams=True)
    EmbedHybrid = _rpc("EmbedHybrid", "_embed_hybrid")
    EmbedHybridStream = _rpc("EmbedHybridStream", "_embed_hybrid", streams=True)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer KEY` metadata on every method of tei.v1 and bertserve.v1 (UNAUTHENTICATED otherwise)."""

    def __init__(self, api_key: str, metrics: Metrics):
        self.api_key = api_key.encode()
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(GUARDED_PREFIXES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if bearer_key_matches(given.encode(), self.api_key):
            return await continuation(details)
        self.metrics.requests.labels(f"grpc {details.method.rsplit('/', 1)[-1]}",
                                     grpc.StatusCode.UNAUTHENTICATED.name).inc()
        handler = await continuation(details)
        refusal = Unauthorized("missing or wrong API key")

        async def refuse(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal.message)

        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class GrpcPortTaken(ValueError):
    """--grpc-port cannot be listened on (taken, or not this machine's address)."""


def check_grpc_port(host: str, port: int) -> None:
    """Refuse a gRPC port that cannot be bound before the server starts, so that a taken port
    exits 2 with one line like any bad flag (gRPC itself binds later, on the server's event loop)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise GrpcPortTaken(f"cannot listen for gRPC on {host}:{port}: {exc.strerror}") from None


async def start_grpc(settings: Settings, runtime: Runtime, metrics: Metrics) -> grpc.aio.Server:
    """Serve tei.v1 and bertserve.v1 (and server reflection) on `settings.host:settings.grpc_port`; messages over
    --payload-limit are refused with RESOURCE_EXHAUSTED, as HTTP bodies over it are with 413."""
    interceptors = [ApiKeyInterceptor(settings.api_key, metrics)] if settings.api_key else []
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", settings.payload_limit)])
    servicer = Servicer(runtime, metrics)
    for _, stubs, names in SERVICES:
        for name in names:
            getattr(stubs, f"add_{name}Servicer_to_server")(servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
    await server.start()
    log.info("gRPC (tei.v1, bertserve.v1) listening on %s:%d", settings.host, port)
    return server
