"""Backends run one padded batch: TVM over the compiled artifact, or PyTorch eager as the oracle.

Both return `artifact.loader.RunResult`, so the batcher and metrics do not care which one runs.
Each also says how to size the intra-op threads of a worker thread (`configure_thread`, called
once on each worker's own thread) and what a batch costs on each of its libraries (`costs`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import tvm

from artifact.bucketing import AnyBucket
from artifact.costs import BatchCosts, Costs
from artifact.errors import ArtifactError
from artifact.levels import artifact_for_this_cpu
from artifact.loader import CompiledModel, RunResult, load_artifact
from artifact.manifest import Manifest


# TVM's ThreadGroup::AffinityMode kBig: use the pool's first N threads (whether they are pinned to
# cores is TVM_BIND_THREADS's choice; the server leaves them unpinned, see service.topology).
TVM_AFFINITY_BIG = 1

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str
    device: str  # where it computes: "cpu" or "cuda" (TEI's x-compute-type)
    manifest: Manifest
    directory: Path
    buckets: list[AnyBucket]  # the libraries' static shapes (artifact.bucketing); empty: run at its own shape
    max_batch: int  # the most inputs one shape-free (generic) run accepts
    max_seq: int
    refused: dict[str, str]  # buckets whose library failed verification, and why
    weights_bytes: int  # the weights it holds: the artifact's weight files, or PyTorch's parameters

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
            bucket: AnyBucket | None = None, tokens: bool = False) -> RunResult: ...

    def warmup(self) -> None: ...

    def configure_thread(self, threads: int) -> None: ...

    def costs(self) -> Costs: ...


class TvmBackend:
    """The compiled libraries; `CompiledModel.run` already keeps one VM per thread."""

    name = "tvm"

    def __init__(self, model: CompiledModel):
        self.model = model
        self.device = model.manifest.target.kind
        self.manifest = model.manifest
        self.directory = model.directory
        self.buckets = model.buckets
        self.max_batch = model.manifest.generic.max_batch
        self.max_seq = model.max_seq
        self.refused = model.refused
        self.weights_bytes = sum((model.directory / entry.file).stat().st_size
                                 for entry in model.manifest.weights.values())

    def run(self, input_ids, attention_mask, token_type_ids, bucket=None, tokens=False) -> RunResult:
        return self.model.run(input_ids, attention_mask, token_type_ids, bucket, tokens)

    def warmup(self) -> None:
        self.model.warmup()

    def configure_thread(self, threads: int) -> None:
        """Size this thread's TVM pool (TVM keeps one per calling thread; see service.topology)."""
        tvm.get_global_func("runtime.config_threadpool")(TVM_AFFINITY_BIG, threads)

    def costs(self) -> Costs:
        return self.model.costs


class TorchBackend:
    """PyTorch eager on the checkpoint the artifact was compiled from, with its fused attention (SDPA,
    transformers' default): same function, same API, on the artifact's device (a CUDA artifact is
    compared with PyTorch on the same GPU)."""

    name = "torch"

    def __init__(self, directory: Path, manifest: Manifest, threads: int | None = None):
        import torch

        from compile.checkpoint import inspect_checkpoint, load_wrapper

        if threads:
            torch.set_num_threads(threads)
        pooling = manifest.pooling if manifest.task == "embed" else "auto"
        info = inspect_checkpoint(Path(manifest.model.path), manifest.task, pooling)
        self.device = manifest.target.kind
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ArtifactError(f"{directory} targets CUDA but PyTorch sees no CUDA device")
        self._torch = torch
        self.module = load_wrapper(info, manifest.task, manifest.dtype, attention="sdpa").to(self.device)
        self.manifest = manifest
        self.directory = directory
        self.buckets: list[AnyBucket] = []
        self.max_batch = manifest.generic.max_batch
        self.max_seq = manifest.generic.max_seq
        self.refused: dict[str, str] = {}
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())

    def run(self, input_ids, attention_mask, token_type_ids, bucket=None, tokens=False) -> RunResult:
        torch = self._torch
        batch, seq = input_ids.shape
        position_ids = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq))
        with torch.inference_mode():
            inputs = [torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
                      for x in (input_ids, attention_mask, token_type_ids, position_ids)]
            hidden = self.module.encode(*inputs)
            output = self.module.pooled(hidden, inputs[1].to(hidden.dtype))
            states = self.module.token_head(hidden) if tokens else None
        return RunResult(output.float().cpu().numpy(), "torch", None, batch * seq, int(np.count_nonzero(attention_mask)),
                         None if states is None else states.float().cpu().numpy())

    def warmup(self) -> None:
        ones = np.ones((1, 2), dtype=np.int64)
        self.run(ones, ones, np.zeros_like(ones))

    def configure_thread(self, threads: int) -> None:
        """PyTorch's intra-op thread count is process-wide: set once, in __init__."""

    def costs(self) -> Costs:
        return BatchCosts([])


def load_backend(directory: Path, kind: str, threads: int | None = None) -> Backend:
    """Load one artifact directory as the chosen backend (`threads`: PyTorch's intra-op threads)."""
    if kind == "torch":
        # a multi-level artifact: its levels share checkpoint and tokenizer
        return TorchBackend(*artifact_for_this_cpu(directory, runs_code=False), threads)
    return TvmBackend(load_artifact(directory))
