"""The HTTP routes: TEI's /embed, /predict (+ /classify), /rerank, /tokenize, /decode and
/similarity, OpenAI's /v1/embeddings and /v1/models, `/` (the first model's task, as TEI routes
it), and probes. A request's `model` picks one of several models by name."""

from __future__ import annotations

import asyncio
import base64
import time
import typing
from typing import Annotated, Any, Awaitable, Callable

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Discriminator, Tag, TypeAdapter, ValidationError
from starlette.responses import JSONResponse, Response

from artifact.embedding_dtypes import quantize

from .errors import InvalidInput, NotSupported, Unavailable
from .inference import Computed, ModelService
from .inputs import (
    Truncation,
    hybrid_outputs,
    one_per_item,
    predict_sequences,
    token_vector_dtype,
    truncation,
    zero_shot_texts,
)
from .runtime import Runtime
from .schemas import (
    ClassifyRequest,
    DecodeRequest,
    EmbedAllRequest,
    EmbedHybridRequest,
    EmbedMultiRequest,
    EmbedRequest,
    OpenAIEmbedding,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    OpenAIUsage,
    RerankRequest,
    SimilarityRequest,
    TokenizeRequest,
)

router = APIRouter()

SCHEMA_REF = "#/components/schemas/{model}"
# JSON schemas of the POST bodies (and the models they use), by component name: `post` bypasses
# FastAPI's body handling, so `with_body_schemas` adds them to the OpenAPI document itself.
BODY_SCHEMAS: dict[str, dict] = {}


def with_body_schemas(openapi):
    """`app.openapi` whose document also holds the POST bodies' schemas."""

    def document() -> dict:
        schema = openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(BODY_SCHEMAS)
        return schema

    return document


class _RequestRoute(APIRoute):
    """A route whose endpoint takes the request and returns the response itself (`post`'s), so
    FastAPI's dependency solving and response serialisation are skipped."""

    def get_route_handler(self):
        return self.endpoint


# What a request whose client disconnected before its answer ends with (nginx's code; nobody reads it).
CLIENT_CLOSED_REQUEST = 499
# The tags of `/`'s body union (ROOT_BODIES), left out of where an error points.
ROOT_TAGS = ("similarity", "task")


def parse_body(validate: Callable[[bytes], Any], raw: bytes) -> Any:
    """Every POST body is parsed this one way: by pydantic's JSON parser, validating as it parses
    (FastAPI's own path, json.loads then validation of the Python objects, cost 0.1 ms more per
    request), within its limits (a deeply nested body is refused, never a RecursionError). Invalid
    JSON, binary, an empty body, wrong types or missing fields: a 422, as FastAPI's."""
    try:
        return validate(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": tuple(part for part in error["loc"] if part not in ROOT_TAGS)}
                  for error in exc.errors()]
        raise RequestValidationError(errors) from None


async def answer_unless_abandoned(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, unless the client disconnects first: then the request's task is cancelled, so its
    inputs still queued leave the queue before they run (as TEI drops them), and it ends with 499."""
    task = asyncio.current_task()
    left = False

    async def watch() -> None:
        nonlocal left
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a transport that cannot tell: the request just runs
            return
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await answer
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        watcher.cancel()


def _add_post(path: str, endpoint, body_doc: dict) -> None:
    router.add_api_route(path, endpoint, methods=["POST"], openapi_extra=body_doc, route_class_override=_RequestRoute)


def post(*paths: str):
    """Register `handler(body, request) -> Response` for POST at `paths`, its body parsed
    (`parse_body`) against the handler's `body` annotation and answered unless the client leaves
    first (`answer_unless_abandoned`). Returns the handler, which `/` calls with a body it parsed."""

    def register(handler):
        schema = typing.get_type_hints(handler)["body"]
        json_schema = schema.model_json_schema(ref_template=SCHEMA_REF)
        BODY_SCHEMAS.update(json_schema.pop("$defs", {}))
        BODY_SCHEMAS[schema.__name__] = json_schema
        body_doc = {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": SCHEMA_REF.format(model=schema.__name__)}}}}}

        async def endpoint(request: Request):
            body = parse_body(schema.model_validate_json, await request.body())
            return await answer_unless_abandoned(request, handler(body, request))

        endpoint.__name__ = handler.__name__
        for path in paths:
            _add_post(path, endpoint, body_doc)
        return handler

    return register


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _truncation(request: Request, body=None) -> Truncation:
    """`body`'s truncation (`inputs.truncation`), where it does not say the server's --auto-truncate;
    without a body (OpenAI's, which has no truncation fields) always the server's."""
    auto_truncate = request.app.state.settings.auto_truncate
    if body is None:
        return truncation(None, auto_truncate=auto_truncate)
    return truncation(body.truncate, body.truncation_direction, auto_truncate=auto_truncate)


def _embedding_dtype(request: Request, body) -> str:
    """`body`'s embedding_dtype, else the server's --embedding-dtype."""
    return body.embedding_dtype or request.app.state.settings.embedding_dtype


def _json(content, headers: dict[str, str]) -> Response:
    """A JSON answer encoded by orjson, numpy arrays included: Python's json module spent a quarter
    of the event loop's time on the floats of the embeddings under load (py-spy)."""
    if isinstance(content, np.ndarray):
        content = np.ascontiguousarray(content)
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json",
                    headers=headers)


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def _headers(service: ModelService, computed: Computed, started: float) -> dict[str, str]:
    """TEI's per-response headers (times in whole ms), which compute path(s) served, and the same
    times to the microsecond as a standard `Server-Timing` header (what a latency breakdown needs)."""
    seconds = time.perf_counter() - started
    total = _ms(seconds)
    parts = {"tokenize": computed.tokenization_seconds, "queue": computed.queue_seconds,
             "inference": computed.inference_seconds, "total": seconds}
    return {
        "server-timing": ", ".join(f"{name};dur={value * 1e3:.3f}" for name, value in parts.items()),
        "x-compute-path": ",".join(computed.paths),
        "x-compute-type": service.batcher.backend.device,
        "x-compute-time": total,
        "x-total-time": total,
        "x-compute-characters": str(computed.characters),
        "x-compute-tokens": str(computed.tokens),
        "x-tokenization-time": _ms(computed.tokenization_seconds),
        "x-queue-time": _ms(computed.queue_seconds),
        "x-inference-time": _ms(computed.inference_seconds),
    }


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' health checks
@router.api_route("/", methods=["GET", "HEAD"])  # TEI's other health routes
@router.api_route("/ping", methods=["GET", "HEAD"])  # SageMaker's
async def health() -> dict:
    """Alive: the process answers, whether or not the models are loaded (/ready: loaded)."""
    return {"status": "ok"}


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> dict:
    runtime = _runtime(request)
    if not runtime.ready:
        raise Unavailable(f"not ready: {runtime.not_ready_reason}")
    return {"status": "ready"}


@router.get("/info")
async def info(request: Request) -> dict:
    return _runtime(request).describe()


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_and_inputs(request: Request, task: str, body):
    """The model serving `task` (or the one `body` names) and the body's inputs, one per item, within the
    client batch limit."""
    service = _runtime(request).model(task, body.model)
    inputs = one_per_item(body.inputs)
    service.check_batch_size(len(inputs))
    return service, inputs


@post("/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    started = time.perf_counter()
    service, inputs = _model_and_inputs(request, "embed", body)
    vectors, computed = await service.embed(inputs, body.normalize, _truncation(request, body), body.dimensions,
                                            body.prompt_name, _embedding_dtype(request, body))
    return _json(vectors, _headers(service, computed, started))


async def _per_input(body: EmbedAllRequest, request: Request, task: str) -> Response:
    """One answer per input from the model serving `task` (embed_all or embed_sparse), in float32."""
    started = time.perf_counter()
    if body.embedding_dtype not in (None, "float32"):
        raise NotSupported(f"embedding_dtype {body.embedding_dtype}: /{task} answers float32; quantized "
                           f"embeddings are pooled ones, on /embed and /v1/embeddings")
    service, inputs = _model_and_inputs(request, task, body)
    answer = service.embed_all if task == "embed_all" else service.embed_sparse
    answers, computed = await answer(inputs, _truncation(request, body), body.prompt_name)
    return _json(answers, _headers(service, computed, started))


@post("/embed_all")
async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
    """TEI's /embed_all: per input, every token's final hidden state (any embedding model: the libraries'
    token output)."""
    return await _per_input(body, request, "embed_all")


@post("/embed_multi")
async def embed_multi(body: EmbedMultiRequest, request: Request) -> Response:
    """Per input, a ColBERT model's token vectors, as PyLate's `encode(is_query=...)` returns them."""
    started = time.perf_counter()
    service, inputs = _model_and_inputs(request, "embed_multi", body)
    dtype = token_vector_dtype(body.embedding_dtype)
    vectors, computed = await service.embed_multi(inputs, body.is_query, _truncation(request, body))
    return _json([quantize(rows, dtype) for rows in vectors], _headers(service, computed, started))


@post("/embed_hybrid")
async def embed_hybrid(body: EmbedHybridRequest, request: Request) -> Response:
    """bge-m3: per input, any of its dense vector, lexical weights and ColBERT vectors from one pass."""
    started = time.perf_counter()
    service, inputs = _model_and_inputs(request, "embed_hybrid", body)
    answers, computed = await service.embed_hybrid(inputs, hybrid_outputs(body.outputs), body.normalize,
                                                   _truncation(request, body), body.prompt_name)
    return _json(answers, _headers(service, computed, started))


@post("/embed_sparse")
async def embed_sparse(body: EmbedAllRequest, request: Request) -> Response:
    """TEI's /embed_sparse: per input, the non-zero SPLADE weights as `{"index", "value"}` pairs."""
    return await _per_input(body, request, "embed_sparse")


@post("/predict", "/classify")
async def classify(body: ClassifyRequest, request: Request) -> Response:
    """A fine-tuned head over TEI's inputs (a text, a pair, or a batch of both: `inputs.predict_sequences`),
    or zero-shot over `labels` (a text or a list of texts: `inputs.zero_shot_texts`) with an NLI classifier
    or an embedding model (`ModelService.zero_shot`)."""
    started = time.perf_counter()
    truncation = _truncation(request, body)
    if body.labels:
        texts, batched = zero_shot_texts(body.inputs)
        service = _runtime(request).model("zero_shot", body.model)
        predictions, computed = await service.zero_shot(texts, body.labels, body.raw_scores, truncation,
                                                        body.hypothesis_template, body.multi_label)
    else:
        if body.hypothesis_template is not None or body.multi_label:
            raise InvalidInput("`hypothesis_template` and `multi_label` apply to zero-shot classification: give "
                               "the candidate `labels`")
        texts, batched = predict_sequences(body.inputs)
        service = _runtime(request).model("classify", body.model)
        service.check_batch_size(len(texts))
        scoring = "none" if body.raw_scores else "auto"
        if body.parameters is not None and body.parameters.function_to_apply is not None:
            scoring = body.parameters.function_to_apply
        predictions, computed = await service.classify(texts, scoring, truncation)
    top_k = body.parameters.top_k if body.parameters is not None else None
    ranked = [ranks[:top_k] for ranks in predictions]
    if body.parameters is not None and not body.labels:  # the HF Inference API's text classification: a list per input
        content = ranked
    else:  # TEI's, and the HF Inference API's zero-shot: one text gets one flat list
        content = ranked if batched else ranked[0]
    return JSONResponse(content, headers=_headers(service, computed, started))


@post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    """TEI's /rerank: a cross-encoder scores each (query, text) pair; best first."""
    started = time.perf_counter()
    service = _runtime(request).model("rerank", body.model)
    service.check_batch_size(len(body.texts))
    ranks, computed = await service.rerank(body.query, body.texts, body.raw_scores, _truncation(request, body),
                                           body.return_text)
    return JSONResponse(ranks, headers=_headers(service, computed, started))


@post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """TEI's /tokenize: the tokens each input would be run as (one list per input, its prompt included,
    the offsets into the prompted text); any model."""
    service = _runtime(request).model(None, body.model)
    texts = one_per_item(body.inputs)
    service.check_batch_size(len(texts))
    return JSONResponse(await service.tokens(texts, body.add_special_tokens, body.prompt_name))


@post("/decode")
async def decode(body: DecodeRequest, request: Request) -> Response:
    """TEI's /decode: token ids (one list, or one per input) back to text; any model."""
    service = _runtime(request).model(None, body.model)
    ids = one_per_item(body.ids)
    service.check_batch_size(len(ids))
    return JSONResponse(await service.decode(ids, body.skip_special_tokens))


@post("/similarity")
async def similarity(body: SimilarityRequest, request: Request) -> Response:
    """TEI's /similarity: the cosine similarity of each sentence's embedding to the source's."""
    started = time.perf_counter()
    service = _runtime(request).model("embed", body.model)
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    service.check_batch_size(len(texts))
    vectors, computed = await service.embed(texts, normalize=True, truncation=_truncation(request, body),
                                            prompt_name=body.prompt_name)
    return JSONResponse((vectors[1:] @ vectors[0]).tolist(), headers=_headers(service, computed, started))


DEFAULT_ROUTES = {"embed": (EmbedRequest, embed), "classify": (ClassifyRequest, classify),
                  "rerank": (RerankRequest, rerank), "embed_all": (EmbedAllRequest, embed_all),
                  "embed_sparse": (EmbedAllRequest, embed_sparse), "embed_multi": (EmbedMultiRequest, embed_multi)}
# `/` parses its body itself (its schema depends on the model and the body): the document lists
# every body it accepts.
DEFAULT_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": SCHEMA_REF.format(model=schema.__name__)}
    for schema in dict.fromkeys([schema for schema, _ in DEFAULT_ROUTES.values()] + [SimilarityRequest])]}}}}}


def _root_kind(payload: Any) -> str:
    return "similarity" if isinstance(payload, dict) and isinstance(payload.get("inputs"), dict) else "task"


# `/`'s body by the first model's task: /similarity's when `inputs` holds a source sentence, else
# the task's, told apart while pydantic parses it, so that `/` parses like every other route.
ROOT_BODIES = {task: TypeAdapter(Annotated[Annotated[SimilarityRequest, Tag("similarity")]
                                           | Annotated[schema, Tag("task")], Discriminator(_root_kind)]).validate_json
               for task, (schema, _) in DEFAULT_ROUTES.items()}


async def default_task(request: Request) -> Response:
    """TEI's `/`: the body of the first model's task (/embed, /predict or /rerank), or /similarity's
    when `inputs` holds a source sentence; what `huggingface_hub.InferenceClient(base_url=...)`
    posts to for feature_extraction, text_classification and sentence_similarity."""
    task = _runtime(request).default_task()
    body = parse_body(ROOT_BODIES[task], await request.body())
    route = similarity if isinstance(body, SimilarityRequest) else DEFAULT_ROUTES[task][1]
    return await answer_unless_abandoned(request, route(body, request))


_add_post("/", default_task, DEFAULT_BODY_DOC)
_add_post("/invocations", default_task, DEFAULT_BODY_DOC)  # SageMaker's, as TEI serves it


@router.get("/v1/models")
@router.get("/models")  # an OpenAI client whose base URL has no /v1, as /embeddings
async def list_models(request: Request) -> dict:
    """OpenAI's model list: every model this server holds, by the name requests select it with."""
    return _runtime(request).list_models()


@router.get("/v1/models/{name}")
@router.get("/models/{name}")
async def retrieve_model(name: str, request: Request) -> dict:
    """OpenAI's model retrieval (the `openai` client's `models.retrieve`): one entry of the list."""
    return _runtime(request).list_model(name)


def packed_bytes(vector: np.ndarray) -> bytes:
    """An embedding as OpenAI's base64 carries it: float32 little-endian, as the `openai` client
    decodes it; a quantized one its bytes as they are (int8 signed, binary and ubinary the packed bits)."""
    return np.asarray(vector, dtype="<f4" if vector.dtype == np.float32 else vector.dtype).tobytes()


@post("/v1/embeddings", "/embeddings")  # /embeddings: an OpenAI client whose base URL has no /v1
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings API; base64 is little-endian float32, as the `openai` client decodes it, or
    a quantized `embedding_dtype`'s bytes (`packed_bytes`)."""
    started = time.perf_counter()
    service = _runtime(request).openai_model(body.model)
    inputs = one_per_item(body.input)
    service.check_batch_size(len(inputs))
    vectors, computed = await service.embed(inputs, normalize=True, truncation=_truncation(request),
                                            dimensions=body.dimensions, prompt_name=body.prompt_name,
                                            embedding_dtype=_embedding_dtype(request, body))
    if body.encoding_format == "base64":
        data = [base64.b64encode(packed_bytes(vector)).decode() for vector in vectors]
    else:
        data = vectors.tolist()
    content = OpenAIEmbeddingResponse(
        data=[OpenAIEmbedding(embedding=embedding, index=i) for i, embedding in enumerate(data)],
        model=service.name,
        usage=OpenAIUsage(prompt_tokens=computed.tokens, total_tokens=computed.tokens),
    )
    return JSONResponse(content.model_dump(), headers=_headers(service, computed, started))
