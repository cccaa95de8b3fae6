"""The one reader of artifact directories, shared by validation, the service and the benchmarks.

It verifies every library against the manifest's sha256, keeps one set of weights on the
device, and runs a batch through the bucket the service's planner would choose for it
(`artifact.costs`: the cheapest measured that fits; padding batch and sequence, where a packed
artifact's libraries take the real tokens only, see `artifact.packed_batch`) or through the
generic dynamic-shape library. TVM's VirtualMachine is not thread-safe, so
each calling thread gets its own VM over the shared module and weights.

It needs only TVM's runtime: with the compiler library absent (or `TVM_USE_RUNTIME_LIB=1`)
artifacts still load and run, so a serving machine or image can leave the 250 MB compiler out.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from .bucketing import AnyBucket
from .costs import Costs, measured_costs
from .errors import ArtifactError
from .hashing import file_sha256
from .levels import artifact_for_this_cpu
from .manifest import Manifest
from .packed_batch import ALIGNMENT, PACKED_INPUT_NAMES, aligned_int64, pack_batch, per_sequence_rows

log = logging.getLogger(__name__)


def device_for(kind: str) -> tvm.runtime.Device:
    if kind == "cuda":
        _load_cuda_runtime()
        return tvm.cuda(0)
    return tvm.cpu(0)


def device_name(device: tvm.runtime.Device) -> str:
    """"cpu", or the GPU's marketing name (what validation and benchmarks report)."""
    return "cpu" if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type() else str(device.device_name)


def _load_cuda_runtime() -> None:
    """Make CUDA libraries loadable in runtime-only mode.

    `import tvm` registers the CUDA device API only when the compiler library is loaded, so the
    runtime's CUDA sidecar is loaded here. TVM 0.27 ships kernels as CUDA source and compiles
    them with NVRTC when a library loads; its compile callback asks the compiler library for the
    current Target (which fails without it), so it is replaced by one naming this GPU's arch.
    """
    import tvm_ffi
    from tvm.base import _LOADED_LIBS, _RUNTIME_ONLY

    if not _RUNTIME_ONLY or "tvm_runtime_cuda" in _LOADED_LIBS:
        return
    from tvm_ffi.libinfo import load_lib_ctypes

    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", mode="RTLD_LOCAL",
            extra_lib_paths=[Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent],
        )
    except (OSError, RuntimeError) as exc:  # no CUDA runtime here: the device will not exist
        log.warning("TVM's CUDA runtime did not load: %s", exc)
        return
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_cuda_for_this_gpu, override=True)


def _compile_cuda_for_this_gpu(code: str) -> bytes:
    from tvm.support import nvcc

    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")


def load_weights(path: Path, names: list[str], device: tvm.runtime.Device) -> list[tvm.runtime.Tensor]:
    from safetensors.numpy import load_file

    if len(set(names)) != len(names):
        raise ArtifactError(f"{path}: the manifest names a weight twice")
    arrays = load_file(str(path))
    missing = [name for name in names if name not in arrays]
    if missing:
        raise ArtifactError(f"{path} lacks weights {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return weight_tensors([arrays[name] for name in names], device)


def weight_tensors(arrays: list[np.ndarray], device: tvm.runtime.Device) -> list[tvm.runtime.Tensor]:
    """`arrays` as a library's weights on `device` (host ones on huge pages: `on_huge_pages`)."""
    if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        return on_huge_pages([np.ascontiguousarray(array) for array in arrays])
    return [tvm.runtime.tensor(array, device) for array in arrays]


HUGE_PAGE = 2 << 20  # x86-64's 2 MB pages


def on_huge_pages(arrays: list[np.ndarray]) -> list[tvm.runtime.Tensor]:
    """Host tensors of `arrays`, copied one after another (each 64-byte aligned) into one region that
    starts on a 2 MB boundary and is advised to Linux as huge pages (MADV_HUGEPAGE, which its default
    `madvise` mode of transparent huge pages waits for). A call streams every weight, MiniLM's 42 MB
    of linears past a 32 MB L3, and on 4 KB pages that is 10,000 pages a call, each a TLB miss and an
    end of the hardware prefetcher's stream: on 2 MB pages MiniLM's calls took 0.97-0.99x the time at
    16 tokens, 0.99x at 128 and 0.99-1.01x at 512 (docs/experiments/weight-pages.md, `python -m loadtest.weight_pages`).
    Where the kernel does not grant them the region keeps 4 KB pages and nothing else changes."""
    spans = [-(-array.nbytes // ALIGNMENT) * ALIGNMENT for array in arrays]
    size = -(-max(sum(spans), 1) // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(region, dtype=np.uint8, count=1).ctypes.data % HUGE_PAGE
    with contextlib.suppress(AttributeError, OSError):  # no madvise (not Linux) or no THP: 4 KB pages
        region.madvise(mmap.MADV_HUGEPAGE, start, size)
    arena = np.frombuffer(region, dtype=np.uint8, count=size, offset=start)
    tensors, offset = [], 0
    for array, span in zip(arrays, spans):
        view = arena[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        tensors.append(tvm.runtime.from_dlpack(view))  # the view keeps the region mapped
        offset += span
    return tensors


# A VM's first call of a CUDA-graph library captures the device's stream into a graph, and another
# thread's launch or allocation meanwhile fails the capture (cudaErrorStreamCaptureUnsupported). All
# VMs share that stream, so GPU work is serial anyway: calls on a GPU run one at a time.
_GPU_CALLS = threading.Lock()


class LibraryRunner:
    """One compiled library over shared weights; safe to call from many threads."""

    def __init__(self, path: Path, device: tvm.runtime.Device, weights: list[tvm.runtime.Tensor]):
        self.path = path
        self.device = device
        self.weights = weights
        self.module = tvm.runtime.load_module(str(path))
        self._on_host = device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()
        self._local = threading.local()
        self._float_output: bool | None = None  # whether the output is float32: one library, one dtype

    def _vm(self) -> VirtualMachine:
        vm = getattr(self._local, "vm", None)
        if vm is None:
            vm = self._local.vm = VirtualMachine(self.module, self.device)
        return vm

    def _main(self):
        """This thread's VM's `main`, looked up once (each lookup is a call into the VM)."""
        main = getattr(self._local, "main", None)
        if main is None:
            main = self._local.main = self._vm()["main"]
        return main

    def set_instrument(self, instrument) -> None:
        """Have this thread's VM call `instrument` around every function it runs (profiling), or
        stop with None."""
        self._vm().set_instrument(instrument)

    def __call__(self, *inputs: np.ndarray) -> np.ndarray:
        """The library's first output (pooled rows, logits, or a `--pooling none` model's token states)."""
        return self.outputs(inputs, tokens=False)[0]

    def outputs(self, inputs: tuple[np.ndarray, ...], tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(first output, token states or None): the token output (an embedding library's second) is
        copied out only when asked for, so that a call that pools pays nothing for it (None: not asked
        for, or a library from before token outputs)."""
        with contextlib.nullcontext() if self._on_host else _GPU_CALLS:
            args = [_host_tensor(x) if self._on_host else
                    tvm.runtime.tensor(np.ascontiguousarray(x, dtype=np.int64), self.device) for x in inputs]
            result = self._main()(*args, *self.weights)
            first = self._host_array(result[0])
            return first, (self._host_array(result[1]) if tokens and len(result) > 1 else None)

    def _host_array(self, output) -> np.ndarray:
        if self._float_output is None:  # reading the dtype took 30 us a call, with the caches full of weights
            self._float_output = output.dtype == "float32"
        if self._on_host and self._float_output:
            # right after a call, with this thread's caches full of weights, a copy through
            # DLPack takes ~40 us where .numpy() takes ~100 and .astype another ~40
            return np.from_dlpack(output).copy()
        return output.numpy().astype(np.float32, copy=False)


def _host_tensor(array: np.ndarray) -> tvm.runtime.Tensor:
    """An int64 host tensor sharing `array` where it is contiguous, writable and aligned (pack_batch's
    are), else a 64-byte aligned copy of it (what DLPack requires): a few microseconds where
    `tvm.runtime.tensor` allocates and copies in 15-20 (six inputs per call)."""
    array = np.asarray(array, dtype=np.int64)
    if array.flags.c_contiguous and array.flags.writeable and array.__array_interface__["data"][0] % ALIGNMENT == 0:
        return tvm.runtime.from_dlpack(array)
    (aligned,) = aligned_int64(array.shape)
    aligned[...] = array
    return tvm.runtime.from_dlpack(aligned)


def model_inputs(input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray | None):
    """The four int64 inputs of the compiled function (position ids are 0..seq-1)."""
    batch, seq = input_ids.shape
    if token_type_ids is None:
        token_type_ids = np.zeros((batch, seq), dtype=np.int64)
    position_ids = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq))
    return input_ids, attention_mask, token_type_ids, position_ids


def pad_to(array: np.ndarray, batch: int, seq: int, value: int = 0) -> np.ndarray:
    padded = np.full((batch, seq), value, dtype=np.int64)
    padded[: array.shape[0], : array.shape[1]] = array
    return padded


@dataclass(frozen=True)
class RunResult:
    output: np.ndarray  # [batch, dim]: pooled embeddings or logits; [batch, seq, hidden]: token states
    path: str  # "bucket-8x128", "bucket-packed-128" or "generic"
    bucket: AnyBucket | None
    computed_tokens: int  # token rows the linear layers ran, padding included
    real_tokens: int
    tokens: np.ndarray | None = None  # [batch, seq, dim]: every token's output, where the run was asked for it

    @property
    def padding_tokens(self) -> int:
        return self.computed_tokens - self.real_tokens


@dataclass
class CompiledModel:
    directory: Path
    manifest: Manifest
    device: tvm.runtime.Device
    runners: dict[AnyBucket, LibraryRunner]
    generic: LibraryRunner
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def buckets(self) -> list[AnyBucket]:
        return sorted(self.runners)

    @property
    def packed(self) -> bool:
        return self.manifest.layout == "packed"

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / self.manifest.tokenizer

    @property
    def max_seq(self) -> int:
        return self.manifest.generic.max_seq

    @cached_property
    def costs(self) -> Costs:
        """What a batch costs on each loaded library (refused ones left out): the planner's measure."""
        return measured_costs(self.manifest, self.buckets)

    def select(self, batch: int, seq: int) -> AnyBucket | None:
        """The bucket the service's planner runs `batch` sequences padded to `seq` on; None: no
        bucket holds them, the generic library runs them."""
        return self.costs.bucket_for(batch, seq)

    def run(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        token_type_ids: np.ndarray | None = None,
        bucket: AnyBucket | None = None,
        tokens: bool = False,
    ) -> RunResult:
        """Run one batch of right-padded rows on `bucket` (the planner's choice for it) or, given
        none, on the one the planner would choose (`select`), else on the generic library; `tokens`:
        with every token's output (`Manifest.token_states`) beside the pooled rows."""
        batch, seq = input_ids.shape
        if bucket is not None and (bucket not in self.runners or not bucket.fits(batch, seq)):
            raise ValueError(f"bucket {bucket.name} cannot run a batch of {batch}x{seq}")
        if bucket is None:
            bucket = self.select(batch, seq)
        return self._run_on(bucket, input_ids, attention_mask, token_type_ids, tokens)

    def run_generic(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                    token_type_ids: np.ndarray | None = None) -> RunResult:
        """Run one batch on the generic library even where a bucket would hold it."""
        return self._run_on(None, input_ids, attention_mask, token_type_ids)

    def library_inputs(self, bucket: AnyBucket | None, input_ids: np.ndarray, attention_mask: np.ndarray,
                       token_type_ids: np.ndarray | None = None) -> tuple[tuple[np.ndarray, ...], int]:
        """The checked inputs of `bucket`'s library (None: the generic one) for a batch, and the token
        rows its linear layers compute."""
        batch, seq = input_ids.shape
        vocab_size = self.manifest.model.vocab_size
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")  # the gather kernel does not check
        if bucket is None:
            generic = self.manifest.generic
            if batch > generic.max_batch or seq > generic.max_seq:
                raise ValueError(
                    f"batch {batch}x{seq} exceeds the generic library's bounds {generic.max_batch}x{generic.max_seq}"
                )
        if self.packed:
            inputs = pack_batch(input_ids, attention_mask, token_type_ids, seq=bucket.seq if bucket else None)
            return inputs, len(inputs[0])  # the real tokens, packed
        if bucket is not None:
            rows = model_inputs(input_ids, attention_mask, token_type_ids)[:3]
            padded = [pad_to(x, bucket.batch, bucket.seq) for x in rows]
            return model_inputs(*padded), bucket.capacity
        return model_inputs(input_ids, attention_mask, token_type_ids), batch * seq

    def _run_on(self, bucket: AnyBucket | None, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray | None, tokens: bool = False) -> RunResult:
        if tokens and not self.manifest.token_states:
            raise ValueError(f"{self.directory} has no token output (an artifact compiled before they were one)")
        batch = input_ids.shape[0]
        inputs, computed = self.library_inputs(bucket, input_ids, attention_mask, token_type_ids)
        real_tokens = computed if self.packed else int(np.count_nonzero(attention_mask))  # packed: the real ones
        output, token_rows = (self.generic if bucket is None else self.runners[bucket]).outputs(inputs, tokens)
        gather = inputs[PACKED_INPUT_NAMES.index("gather")] if self.packed else None
        if self.packed and self.manifest.token_outputs:
            output = per_sequence_rows(output, gather)
        if token_rows is not None:
            token_rows = (per_sequence_rows(token_rows, gather) if self.packed else token_rows)[:batch]
        path = "generic" if bucket is None else f"bucket-{bucket.name}"
        return RunResult(output[:batch], path, bucket, computed, real_tokens, token_rows)

    def warmup(self) -> None:
        """Run every library once, so first requests do not pay for lazy initialisation."""
        for bucket in self.buckets:
            ones = np.ones((bucket.rows, bucket.seq), dtype=np.int64)
            self.run(ones, ones, bucket=bucket)
        ones = np.ones((1, 2), dtype=np.int64)
        self.run_generic(ones, ones)


def _verified(directory: Path, library: str, sha256: str) -> Path:
    path = directory / library
    if not path.is_file():
        raise ArtifactError(f"library {library} is missing from {directory}")
    actual = file_sha256(path)
    if actual != sha256:
        raise ArtifactError(f"library {library} has sha256 {actual[:12]}..., manifest says {sha256[:12]}...")
    return path


def load_artifact(directory: Path | str, device: tvm.runtime.Device | None = None) -> CompiledModel:
    """Load an artifact directory; a bucket whose library fails verification is refused, not used."""
    directory, manifest = artifact_for_this_cpu(directory)  # a multi-level artifact: the level this CPU runs best
    device = device or device_for(manifest.target.kind)
    if manifest.target.kind == "cuda" and not device.exist:
        raise ArtifactError(f"{directory} holds CUDA libraries but no CUDA device is present")
    weights = {}
    for strategy, entry in manifest.weights.items():
        weights_path = directory / entry.file
        if not weights_path.is_file() or file_sha256(weights_path) != entry.sha256:
            raise ArtifactError(f"weights {entry.file} are missing or do not match the manifest's sha256")
        weights[strategy] = load_weights(weights_path, entry.names, device)
    runners: dict[AnyBucket, LibraryRunner] = {}
    refused: dict[str, str] = {}
    for entry in manifest.buckets:
        bucket = entry.bucket
        try:
            path = _verified(directory, entry.library, entry.sha256)
            runners[bucket] = LibraryRunner(path, device, weights[entry.strategy])
        except ArtifactError as exc:
            refused[bucket.name] = str(exc)
            log.warning("refusing bucket %s: %s", bucket.name, exc)
    generic_path = _verified(directory, manifest.generic.library, manifest.generic.sha256)
    generic = LibraryRunner(generic_path, device, weights[manifest.generic.strategy])
    return CompiledModel(directory, manifest, device, runners, generic, refused)
