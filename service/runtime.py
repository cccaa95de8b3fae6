"""What the server holds: the artifacts' models, loaded and warmed in the background.

The HTTP server starts listening at once (so `/health` answers and `/ready` says 503); loading,
warm-up of every library on every worker thread, and starting the batchers happen in a task,
after which `/ready` turns 200 (and back to 503 while a batcher is down). Manifests are read and
the core topology is planned up front, so a wrong directory or flag fails fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from artifact.cores import usable_cores
from artifact.loader import check_cpu_features
from artifact.manifest import Manifest

from .backends import Backend, load_backend
from .batcher import Batcher
from .errors import NotSupported, Unavailable
from .inference import ModelService
from .metrics import Metrics
from .planning import BatchLimits
from .settings import Settings
from .tokenization import TextTokenizer, max_input_length
from .topology import plan_topology

log = logging.getLogger(__name__)

BackendLoader = Callable[[Path, str, "int | None"], Backend]  # (directory, backend, threads per worker)


class ArtifactSetError(ValueError):
    """The --artifacts given cannot be served together."""


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics, loader: BackendLoader = load_backend,
                 on_fatal: Callable[[], None] | None = None):
        self.settings = settings
        self.metrics = metrics
        self.loader = loader
        self.on_fatal = on_fatal
        self.manifests: dict[str, tuple[Path, Manifest]] = {}
        for directory in settings.artifacts:
            manifest = Manifest.read(directory)
            if settings.backend == "tvm":
                check_cpu_features(Path(directory), manifest.target)  # before listening: exit 2, not SIGILL later
            if manifest.task in self.manifests:
                raise ArtifactSetError(f"two {manifest.task} artifacts given; at most one per task")
            self.manifests[manifest.task] = (Path(directory), manifest)
        self.topology = plan_topology(settings.cores or usable_cores(), settings.backend, settings.workers,
                                      settings.threads_per_worker, settings.wide_worker)
        # TVM sizes each thread's pool from TVM_NUM_THREADS when that thread first needs one (the
        # workers then use part of it, see TvmBackend.configure_thread); unpinned threads let the
        # OS place the wide worker and the narrow ones, whose pools would otherwise pin to the same
        # cores. Set before any pool exists.
        os.environ["TVM_NUM_THREADS"] = str(self.topology.cores)
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        self.models: dict[str, ModelService] = {}
        self.backends: dict[str, Backend] = {}
        self.weights_bytes: dict[str, int] = {}  # per task, once its weights are loaded
        self.error: str | None = None
        self.loaded = False
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    @property
    def ready(self) -> bool:
        return self.loaded and all(service.batcher.healthy for service in self.models.values())

    @property
    def not_ready_reason(self) -> str:
        if self.error:
            return self.error
        down = [f"{task}: {service.batcher.failure or 'batcher restarting'}" for task, service in self.models.items()
                if not service.batcher.healthy]
        return "; ".join(down) if down and self.loaded else "warming up"

    @property
    def primary_task(self) -> str:
        return "embed" if "embed" in self.manifests else "classify"

    async def start(self) -> None:
        """Load, warm up and start every model; on failure record why and ask the server to stop."""
        started = time.perf_counter()
        try:
            for task, (directory, manifest) in self.manifests.items():
                log.info("loading %s artifact %s (backend %s)", task, directory, self.settings.backend)
                backend = await asyncio.to_thread(self.loader, directory, self.settings.backend,
                                                  self.topology.threads_per_worker)
                service = self._service(directory, manifest, backend)
                await asyncio.to_thread(service.batcher.warmup_workers)
                self.backends[task], self.models[task] = backend, service
                self.weights_bytes[task] = weights_bytes(directory, manifest)
            for service in self.models.values():
                service.batcher.start()
        except Exception as exc:  # noqa: BLE001 - any load failure means the server cannot serve
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("loading failed: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.loaded = True
        log.info("ready in %.1f s (%s)", time.perf_counter() - started, self.topology)

    def _service(self, directory: Path, manifest: Manifest, backend: Backend) -> ModelService:
        settings = self.settings
        tokenizer_dir = directory / manifest.tokenizer
        limit = max_input_length(min(manifest.model.max_position_embeddings, backend.max_seq), tokenizer_dir)
        limits = BatchLimits(settings.max_batch_tokens, settings.max_batch_requests, backend.max_batch)
        batcher = Batcher(manifest.task, backend, limits, self.topology, max_wait_ms=settings.max_wait_ms,
                          sort_window=settings.sort_window, capacity=settings.max_concurrent_requests,
                          request_timeout_s=settings.request_timeout, metrics=self.metrics, costs=backend.costs(),
                          on_fatal=self.on_fatal)
        return ModelService(directory.name, manifest.task, manifest.labels,
                            TextTokenizer(tokenizer_dir / "tokenizer.json", limit), batcher,
                            self._tokenizer_pool, settings.max_client_batch_size, manifest.output_dim,
                            manifest.problem_type)

    def model(self, task: str) -> ModelService:
        if task not in self.manifests:
            raise NotSupported(f"this server has no {task} model")
        if not self.loaded:
            raise Unavailable(f"model is not ready: {self.error}" if self.error else "model is loading")
        return self.models[task]

    def drain(self) -> None:
        """Shutdown has begun: refuse new inputs, dispatch queued ones without waiting for company."""
        for service in self.models.values():
            service.batcher.drain()

    async def close(self) -> None:
        for service in self.models.values():
            await service.batcher.close()
        self._tokenizer_pool.shutdown(wait=True)

    def describe(self) -> dict:
        """The /info body: TEI's fields for the primary model, then every model in detail."""
        settings = self.settings
        directory, manifest = self.manifests[self.primary_task]
        service = self.models.get(self.primary_task)
        if manifest.task == "embed":
            model_type = {"embedding": {"pooling": manifest.pooling}}
        else:
            model_type = {"classifier": {"id2label": dict(enumerate(manifest.labels)),
                                         "label2id": {label: i for i, label in enumerate(manifest.labels)}}}
        return {
            "model_id": directory.name,
            "model_sha": manifest.model.weights_sha256,
            "model_dtype": manifest.dtype,
            "model_type": model_type,
            "max_concurrent_requests": settings.max_concurrent_requests,
            "max_input_length": service.tokenizer.max_length if service else None,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_batch_requests": settings.max_batch_requests,
            "max_client_batch_size": settings.max_client_batch_size,
            "auto_truncate": settings.auto_truncate,
            "backend": settings.backend,
            "ready": self.ready,
            "batching": {"max_wait_ms": settings.max_wait_ms, "sort_window": settings.sort_window,
                         "payload_limit": settings.payload_limit, "request_timeout_s": settings.request_timeout},
            "topology": self.topology.describe(),
            "memory": {"rss_bytes": resident_bytes(), "weights_bytes": sum(self.weights_bytes.values())},
            "models": [self._describe_model(task, directory, manifest) for task, (directory, manifest)
                       in self.manifests.items()],
        }

    def _describe_model(self, task: str, directory: Path, manifest: Manifest) -> dict:
        service = self.models.get(task)
        backend = self.backends.get(task)
        return {
            "model_id": directory.name,
            "task": task,
            "artifact": str(directory),
            "checkpoint": manifest.model.path,
            "target": manifest.target.model_dump(),
            "dtype": manifest.dtype,
            "layout": manifest.layout,
            "pooling": manifest.pooling,
            "labels": manifest.labels,
            "output_dim": manifest.output_dim,
            "max_input_length": service.tokenizer.max_length if service else None,
            "buckets": [{"name": b.bucket.name, "batch": b.batch, "seq": b.seq, "strategy": b.strategy}
                        for b in manifest.buckets],
            "refused_buckets": backend.refused if backend else {},
            "weights_bytes": self.weights_bytes.get(task),
            "batch_costs": (None if service is None else
                            "measured latency" if service.batcher.costs.measured else "tokens"),
            "generic": {"max_batch": manifest.generic.max_batch, "max_seq": manifest.generic.max_seq,
                        "strategy": manifest.generic.strategy},
            "versions": {"tvm": manifest.tvm_version, "torch": manifest.torch_version,
                         "transformers": manifest.transformers_version},
        }


def weights_bytes(directory: Path, manifest: Manifest) -> int:
    """Bytes of the weight files an artifact loads (every weight set its libraries use)."""
    return sum((directory / entry.file).stat().st_size for entry in manifest.weights.values())


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc), or None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
