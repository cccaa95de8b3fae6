"""What the server holds: the artifacts' models, loaded and warmed in the background.

The HTTP server starts listening at once (so `/health` answers and `/ready` says 503); loading,
warm-up of every library on every worker thread, and starting the batchers happen in a task,
after which `/ready` turns 200 (and back to 503 while a batcher is down). Manifests are read and
the core topology is planned up front, so a wrong directory or flag fails fast; where the artifact
must first be built (a --model-id the compile cache does not hold yet), that task builds it first,
and until it is built every route that needs a model answers 503 as well.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Callable, Protocol

from artifact.cores import limit_pool_spinning, usable_cores
from artifact.embedding_dtypes import CALIBRATED_DTYPES, EMBEDDING_DTYPES
from artifact.levels import artifact_for_this_cpu
from artifact.manifest import Manifest

from .backends import Backend, load_backend
from .batcher import Batcher
from .errors import ModelNotFound, NotSupported, Unavailable
from .inference import UNCALIBRATED, ModelService, entailment_index
from .lanes import Lanes
from .memory import resident_bytes
from .metrics import Metrics
from .planning import BatchLimits
from .settings import Settings
from .tokenization import Prompts, TextTokenizer, max_input_length
from .topology import cores_to_use, plan_topology

log = logging.getLogger(__name__)

VERSION = package_metadata.version("bert-tvm-serve")

BackendLoader = Callable[[Path, str, "int | None"], Backend]  # (directory, backend, threads per worker)


class ArtifactSetError(ValueError):
    """The --artifacts given cannot be served together."""


class PendingArtifact(Protocol):
    """An artifact to build before it can be read (service.model_cache.CompileJob: a --model-id's compile)."""

    status: str  # what it is doing, for /ready

    async def run(self) -> None: ...


@dataclass(frozen=True)
class ServedArtifact:
    name: str  # what requests select it by (`model`): --served-name, or the directory's name
    directory: Path
    manifest: Manifest
    prompts: Prompts  # an embedding model's sentence-transformers prompts; none for a classifier


def served_artifacts(settings: Settings) -> list[ServedArtifact]:
    """Read every manifest and name every model; names are unique, so `model` selects one."""
    names = settings.served_names or []
    if len(names) > len(settings.artifacts):
        raise ArtifactSetError(f"{len(names)} --served-name for {len(settings.artifacts)} --artifacts")
    served = []
    for i, given in enumerate(settings.artifacts):
        # a multi-level artifact: the level this CPU runs best; refused before listening (exit 2, not SIGILL later)
        directory, manifest = artifact_for_this_cpu(given, runs_code=settings.backend == "tvm")
        prompts = Prompts({}, "")
        if manifest.task == "embed":
            try:
                prompts = Prompts.of_checkpoint(directory / manifest.tokenizer, settings.default_prompt_name,
                                                settings.default_prompt)
            except ValueError as exc:
                raise ArtifactSetError(f"{given}: {exc}") from None
        served.append(ServedArtifact(names[i] if i < len(names) else Path(given).name, directory, manifest, prompts))
    taken = [artifact.name for artifact in served]
    twice = sorted({name for name in taken if taken.count(name) > 1})
    if twice:
        raise ArtifactSetError(f"two models are named {twice[0]!r}; name them apart with --served-name")
    check_tei_choices(served, settings)
    check_embedding_dtype(served, settings)
    return served


# TEI's --dtype values by what /info's model_dtype calls them
TEI_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def check_tei_choices(served: list[ServedArtifact], settings: Settings) -> None:
    """TEI's --dtype and --pooling pick what its model computes at load time; here both were
    chosen when compiling, so they are accepted where every model already is what they ask."""
    for artifact in served:
        manifest = artifact.manifest
        dtype = TEI_DTYPES.get(model_dtype(manifest), model_dtype(manifest))
        if settings.dtype is not None and dtype != settings.dtype:
            raise ArtifactSetError(
                f"--dtype {settings.dtype}: model {artifact.name!r} computes in {model_dtype(manifest)}, chosen when "
                f"it was compiled; compile it with bert-compile --precision fp32|bf16|int8 (float16: --target cuda "
                f"--dtype float16), or leave --dtype out")
        pooling = tei_model_type(manifest).get("embedding", {}).get("pooling")
        if settings.pooling is not None and pooling is not None and pooling != settings.pooling:
            raise ArtifactSetError(
                f"--pooling {settings.pooling}: model {artifact.name!r} pools by {pooling}, chosen when it was "
                f"compiled; compile it with bert-compile --pooling mean|cls|max|none|splade, or leave --pooling out")


def check_embedding_dtype(served: list[ServedArtifact], settings: Settings) -> None:
    """--embedding-dtype int8 / uint8 needs every embedding model's calibration ranges: refused at
    start rather than on every request that names no dtype."""
    lacking = [artifact.name for artifact in served
               if model_kind(artifact.manifest) == "embed" and artifact.manifest.embedding_ranges is None]
    if settings.embedding_dtype in CALIBRATED_DTYPES and lacking:
        raise ArtifactSetError(
            f"--embedding-dtype {settings.embedding_dtype}: model {lacking[0]!r} {UNCALIBRATED}, or serve binary "
            f"or ubinary")


def embedding_dtypes(manifest: Manifest) -> list[str]:
    """The dtypes a model answers embeddings in: none but a pooled embedding model's, int8 and uint8
    where it records calibration ranges."""
    if model_kind(manifest) != "embed":
        return []
    return [dtype for dtype in EMBEDDING_DTYPES
            if dtype not in CALIBRATED_DTYPES or manifest.embedding_ranges is not None]


def freeze_startup_objects() -> None:
    """Move every object alive now into the garbage collector's permanent generation. A full
    collection walks every tracked object, and a loaded server holds ~270k (modules, tokenizers,
    TVM's): 120-140 ms on a Zen 4 core, in which the event loop and every request in flight wait
    (`python -c "import gc, time, service.app; from artifact.loader import load_artifact;
    m = load_artifact('artifacts/minilm-cpu'); t = time.perf_counter(); gc.collect();
    print(time.perf_counter() - t)"`). What startup built lives as long as the server, so later full
    collections need walk only what came after it. Garbage is collected first, not kept for good."""
    gc.collect()
    gc.freeze()


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics, loader: BackendLoader = load_backend,
                 on_fatal: Callable[[], None] | None = None, pending: PendingArtifact | None = None):
        self.settings = settings
        self.metrics = metrics
        self.loader = loader
        self.on_fatal = on_fatal
        self.pending = pending  # built (for the CPU: no GPU to plan for) before the artifacts are read
        self._artifacts = served_artifacts(settings) if pending is None else []
        self.topology = plan_topology(cores_to_use(settings.cores, usable_cores()), settings.backend, settings.workers,
                                      settings.threads_per_worker, settings.wide_worker, settings.queue_ahead,
                                      gpu=any(a.manifest.target.kind == "cuda" for a in self._artifacts))
        # TVM sizes each thread's pool from TVM_NUM_THREADS when that thread first needs one (the
        # workers then use part of it, see TvmBackend.configure_thread); unpinned threads let the
        # OS place the wide worker and the narrow ones, whose pools would otherwise pin to the same
        # cores. An idle pool sleeps ~1 ms after a batch instead of spinning on a core. Set before
        # any pool exists.
        os.environ["TVM_NUM_THREADS"] = str(self.topology.cores)
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        limit_pool_spinning()
        self.models: dict[str, ModelService] = {}  # by name, in --artifacts order, once loaded
        self.backends: dict[str, Backend] = {}
        self.lanes: Lanes | None = None  # every model's batches run on the same workers, within the cores
        self.error: str | None = None
        self.loaded = False
        self._tokenizer_pool = ThreadPoolExecutor(settings.tokenization_workers, thread_name_prefix="tokenize")
        self.tracing = None
        if settings.otlp_endpoint:  # the exporter's imports (~0.1 s) only where traces are wanted
            from .tracing import Tracing

            self.tracing = Tracing(settings.otlp_endpoint, settings.otlp_service_name)

    @property
    def artifacts(self) -> list[ServedArtifact]:
        """The models served, in --artifacts order; 503 while the artifact is still being built."""
        if self.pending is not None:
            raise Unavailable(f"model is not ready: {self.not_ready_reason}")
        return self._artifacts

    @property
    def ready(self) -> bool:
        return self.loaded and all(service.batcher.healthy for service in self.models.values())

    @property
    def not_ready_reason(self) -> str:
        if self.error:
            return self.error
        if self.pending is not None:
            return self.pending.status
        down = [f"{name}: {service.batcher.failure or 'batcher restarting'}" for name, service in self.models.items()
                if not service.batcher.healthy]
        return "; ".join(down) if down and self.loaded else "warming up"

    @property
    def failure(self) -> str | None:
        """Why this server can no longer serve (loading failed, or a batcher gave up), else None."""
        given_up = [f"{name}: {service.batcher.failure}" for name, service in self.models.items()
                    if service.batcher.failure]
        return self.error or "; ".join(given_up) or None

    @property
    def primary(self) -> ServedArtifact:
        """The first model given: what `/` serves and /info's TEI fields describe."""
        return self.artifacts[0]

    async def start(self) -> None:
        """Load, warm up and start every model; on failure record why and ask the server to stop."""
        started = time.perf_counter()
        try:
            if self.pending is not None:
                await self.pending.run()
                self._artifacts = await asyncio.to_thread(served_artifacts, self.settings)
                self.pending = None
            for artifact in self.artifacts:
                log.info("loading %s artifact %s as %r (backend %s)", artifact.manifest.task, artifact.directory,
                         artifact.name, self.settings.backend)
                backend = await asyncio.to_thread(self.loader, artifact.directory, self.settings.backend,
                                                  self.topology.threads_per_worker)
                if self.lanes is None:
                    self.lanes = Lanes(self.topology, backend.configure_thread)
                service = self._service(artifact, backend)
                await asyncio.to_thread(service.batcher.warmup_workers)
                self.backends[artifact.name], self.models[artifact.name] = backend, service
            for service in self.models.values():
                service.batcher.start()
        except Exception as exc:  # noqa: BLE001 - any load failure means the server cannot serve
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("loading failed: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal()
            return
        freeze_startup_objects()
        self.loaded = True
        log.info("ready in %.1f s (%s)", time.perf_counter() - started, self.topology)

    def _service(self, artifact: ServedArtifact, backend: Backend) -> ModelService:
        settings, manifest = self.settings, artifact.manifest
        tokenizer_dir = artifact.directory / manifest.tokenizer
        limit = max_input_length(min(manifest.model.max_position_embeddings, backend.max_seq), tokenizer_dir)
        limits = BatchLimits(settings.max_batch_tokens, settings.max_batch_requests, backend.max_batch)
        batcher = Batcher(artifact.name, backend, limits, self.lanes, max_wait_ms=settings.max_wait_ms,
                          sort_window=settings.sort_window, capacity=settings.max_concurrent_requests,
                          request_timeout_s=settings.request_timeout, metrics=self.metrics, costs=backend.costs(),
                          on_fatal=self.on_fatal)
        return ModelService(artifact.name, manifest.task, manifest.labels,
                            TextTokenizer(tokenizer_dir / "tokenizer.json", limit, manifest.model.vocab_size), batcher,
                            self._tokenizer_pool, settings.max_client_batch_size, manifest.output_dim,
                            manifest.problem_type, artifact.prompts, self.tracing, manifest.embedding_ranges)

    def model(self, task: str | None, name: str | None = None) -> ModelService:
        """The model a request asks for by `name`, else the first one serving `task` (embed,
        classify, rerank: a classifier with one label, zero_shot: an embedding model or an NLI
        classifier; None: any, the first model given)."""
        if name is not None:
            artifact = self.served(name)
            if task is not None and not serves(artifact.manifest, task):
                manifest = artifact.manifest
                raise NotSupported(f"model {name!r} is {describe_kind(manifest)}{labels_of(manifest, task)}, not "
                                   f"{KIND_OF_TASK[task]}{route_hint(manifest)}")
        else:
            artifact = next((artifact for artifact in self.artifacts
                             if task is None or serves(artifact.manifest, task)), None)
            if artifact is None:
                served = "; ".join(f"{a.name!r}, {describe_kind(a.manifest)}, on POST "
                                   f"{ROUTE_OF_TASK[model_kind(a.manifest)]}" for a in self.artifacts)
                raise NotSupported(f"no model of this server is {KIND_OF_TASK[task]}; it serves {served}")
        if not self.loaded:
            raise Unavailable(f"model is not ready: {self.error}" if self.error else "model is loading")
        return self.models[artifact.name]

    def openai_model(self, name: str | None) -> ModelService:
        """OpenAI's `model`: with one model served, any name is that one (clients send their own
        default, LangChain's `text-embedding-ada-002`; the answer's `model` says which answered);
        with several, the name selects one as everywhere else."""
        return self.model("embed", name if len(self.artifacts) > 1 else None)

    def default_task(self) -> str:
        """TEI's `/`: the first model's task (embed, embed_all, embed_sparse, predict, or rerank for
        a one-label classifier)."""
        return model_kind(self.primary.manifest)

    def drain(self) -> None:
        """Shutdown has begun: queued inputs, and those of requests received before it, are dispatched
        without waiting for company (the servers refuse new connections themselves)."""
        for service in self.models.values():
            service.batcher.drain()

    async def close(self) -> None:
        """Drain every model at once against one deadline, the request timeout: no admitted request
        waits longer for its answer anyway (deploy/k8s gives the pod more than that to stop)."""
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout
        finished = await asyncio.gather(*(service.batcher.close(deadline) for service in self.models.values()))
        if self.lanes is not None:
            self.lanes.shutdown(wait=all(finished))  # a stuck batch is left behind rather than hang shutdown
        self._tokenizer_pool.shutdown(wait=True)
        if self.tracing is not None:
            self.tracing.shutdown()

    def describe(self) -> dict:
        """The /info body: TEI's fields for the first model, then every model in detail."""
        settings = self.settings
        primary = self.primary
        service = self.models.get(primary.name)
        return {
            "model_id": primary.name,
            # TEI's: the Hub commit; a checkpoint from a local directory has none, its weights' sha256 stands in
            "model_sha": primary.manifest.model.sha or primary.manifest.model.weights_sha256,
            "model_dtype": model_dtype(primary.manifest),
            "served_model_name": primary.name,
            "model_type": tei_model_type(primary.manifest),
            "max_concurrent_requests": settings.max_concurrent_requests,
            "max_input_length": service.tokenizer.max_length if service else None,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_batch_requests": settings.max_batch_requests,
            "max_client_batch_size": settings.max_client_batch_size,
            "auto_truncate": settings.auto_truncate,
            "embedding_dtype": settings.embedding_dtype,
            "tokenization_workers": settings.tokenization_workers,
            "version": VERSION, "sha": None, "docker_label": None,  # TEI's build fields
            "backend": settings.backend,
            "ready": self.ready,
            "batching": {"max_wait_ms": settings.max_wait_ms, "sort_window": settings.sort_window,
                         "payload_limit": settings.payload_limit, "request_timeout_s": settings.request_timeout},
            "topology": self.topology.describe(),
            "memory": {"rss_bytes": resident_bytes(),
                       "weights_bytes": sum(backend.weights_bytes for backend in self.backends.values())},
            "models": [self._describe_model(artifact) for artifact in self.artifacts],
        }

    def list_models(self) -> dict:
        """OpenAI's GET /v1/models."""
        return {"object": "list", "data": [openai_model_entry(artifact) for artifact in self.artifacts]}

    def list_model(self, name: str) -> dict:
        """OpenAI's GET /v1/models/{name}."""
        return openai_model_entry(self.served(name))

    def served(self, name: str) -> ServedArtifact:
        """The model served under `name`; 404 naming the served ones where none is."""
        artifact = next((artifact for artifact in self.artifacts if artifact.name == name), None)
        if artifact is None:
            raise ModelNotFound(f"model {name!r} is not served here; GET /v1/models lists "
                                f"{', '.join(repr(a.name) for a in self.artifacts)}")
        return artifact

    def _describe_model(self, artifact: ServedArtifact) -> dict:
        name, directory, manifest = artifact.name, artifact.directory, artifact.manifest
        service = self.models.get(name)
        backend = self.backends.get(name)
        return {
            "model_id": name,
            "task": manifest.task,
            "model_type": tei_model_type(manifest),
            "artifact": str(directory),
            "checkpoint": manifest.model.path,
            "target": manifest.target.model_dump(),
            "dtype": model_dtype(manifest),
            "quantization": manifest.quantization.model_dump() if manifest.quantization else None,
            "layout": manifest.layout,
            "pooling": manifest.pooling,
            "labels": manifest.labels,
            "output_dim": manifest.output_dim,
            "embedding_dtypes": embedding_dtypes(manifest),
            "max_input_length": service.tokenizer.max_length if service else None,
            "prompts": service.prompts.describe() if service else None,
            "buckets": [{"name": b.bucket.name, "batch": b.batch, "seq": b.seq, "strategy": b.strategy}
                        for b in manifest.buckets],
            "refused_buckets": backend.refused if backend else {},
            "weights_bytes": backend.weights_bytes if backend else None,
            "batch_costs": (None if service is None else
                            "measured latency" if service.batcher.costs.measured else "tokens"),
            "generic": {"max_batch": manifest.generic.max_batch, "max_seq": manifest.generic.max_seq,
                        "strategy": manifest.generic.strategy},
            "versions": {"tvm": manifest.tvm_version, "torch": manifest.torch_version,
                         "transformers": manifest.transformers_version},
        }


KIND_OF_TASK = {"embed": "an embedding model", "classify": "a classifier",
                "rerank": "a reranker (a one-label classifier)",
                "embed_all": "a token-embedding model (compiled with --pooling none)",
                "embed_sparse": "a sparse (SPLADE) model (compiled with --task sparse)",
                "zero_shot": "an embedding model or an NLI classifier (one of whose labels is entailment) for "
                             "zero-shot `labels`"}
ROUTE_OF_TASK = {"embed": "/embed", "classify": "/predict", "rerank": "/rerank", "embed_all": "/embed_all",
                 "embed_sparse": "/embed_sparse"}


def openai_model_entry(artifact: ServedArtifact) -> dict:
    """A model as OpenAI's /v1/models lists it, with its task."""
    return {"id": artifact.name, "object": "model", "owned_by": "bert-tvm-serve",
            "created": int(datetime.fromisoformat(artifact.manifest.created_at).timestamp()),
            "task": model_kind(artifact.manifest)}


def model_kind(manifest: Manifest) -> str:
    """The one task (route family) a model answers."""
    if manifest.task == "classify":
        return "rerank" if manifest.is_reranker else "classify"
    if manifest.token_outputs:
        return "embed_all"
    return "embed_sparse" if manifest.sparse_outputs else "embed"


def serves(manifest: Manifest, task: str) -> bool:
    """Which routes a model answers: a reranker is a classifier with one label, as in TEI (and
    still answers /predict); an embedding model's pooling decides between /embed, /embed_all and
    /embed_sparse; zero-shot `labels` take a pooled embedding model or an NLI classifier."""
    kind = model_kind(manifest)
    if task == "zero_shot":
        return kind == "embed" or (manifest.task == "classify" and entailment_index(manifest.labels) is not None)
    return kind == task or (task == "classify" and kind == "rerank")


def labels_of(manifest: Manifest, task: str) -> str:
    """A classifier refused zero-shot: what its labels are instead of entailment."""
    if task != "zero_shot" or manifest.task != "classify":
        return ""
    return f" with labels {', '.join(manifest.labels)}"


def describe_kind(manifest: Manifest) -> str:
    return KIND_OF_TASK[model_kind(manifest)]


def route_hint(manifest: Manifest) -> str:
    """Where a model of this kind is served: the refusal of a route names the one to use."""
    return f"; {describe_kind(manifest)} is served on POST {ROUTE_OF_TASK[model_kind(manifest)]}"


def model_dtype(manifest: Manifest) -> str:
    """What the linear layers compute in: fp32, bf16 or int8 (CUDA: the artifact's dtype)."""
    return manifest.linear_precision


def tei_model_type(manifest: Manifest) -> dict:
    """TEI's /info `model_type`: embedding (with pooling), classifier or reranker (with labels)."""
    if manifest.task == "embed":
        return {"embedding": {"pooling": "splade" if manifest.sparse_outputs else manifest.pooling}}
    labels = {"id2label": dict(enumerate(manifest.labels)),
              "label2id": {label: i for i, label in enumerate(manifest.labels)}}
    return {"reranker" if manifest.is_reranker else "classifier": labels}
