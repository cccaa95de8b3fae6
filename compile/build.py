"""Targets, shape specialisation and library builds (CPU through a fusing pipeline, CUDA through dlight)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import tvm
from tvm import relax

from artifact.bucketing import AnyBucket, Bucket
from artifact.cpu_features import missing_on_host, target_features

from .capabilities import KernelConfig
from .errors import CompileError
from .importer import symbolic_dims
from .kernels.linking import linked_objects
from .lowering import tir_pipeline
from .passes.specialize import specialize_te_kernels
from .schedule import cpu_pipeline


def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. znver3, sapphirerapids)."""
    return str(tvm.target.codegen.llvm_get_system_cpu())


def check_mcpu(mcpu: str | None) -> None:
    """Refuse a CPU name LLVM does not know: it would silently build for a generic x86 instead."""
    if mcpu is not None and mcpu not in tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target("llvm")):
        raise CompileError(f"--mcpu {mcpu} is not a CPU LLVM knows; e.g. x86-64-v3 (AVX2), x86-64-v4 (AVX-512), "
                           "znver4, sapphirerapids")


@functools.cache
def _model_features(mcpu: str) -> tuple[str, ...]:
    """The recorded features LLVM's CPU `mcpu` has (a few dozen LLVM queries: asked once per name)."""
    return tuple(target_features(tvm.target.Target({"kind": "llvm", "mcpu": mcpu})))


def host_llvm(flags: set[str] | None = None) -> dict:
    """This machine's CPU as an llvm target, less what it hides.

    LLVM names the CPU by its model, and the name implies that model's features; a VM may hide
    some (an Emerald Rapids guest without AMX or AVX512_BF16), and code using them would die with
    SIGILL here. The hidden ones of the features code generation may use (`cpu_features.FEATURES`)
    are turned off in `mattr`, much as clang's `-march=native` turns off every hidden one. `flags`:
    this CPU's /proc/cpuinfo flags by default.
    """
    mcpu = host_cpu()
    hidden = missing_on_host(_model_features(mcpu), flags) or []
    return {"kind": "llvm", "mcpu": mcpu, **({"mattr": [f"-{feature}" for feature in hidden]} if hidden else {})}


def make_target(kind: str, cuda_arch: str = "sm_90", mcpu: str | None = None) -> tvm.target.Target:
    """A target for `mcpu` (LLVM's CPU name, with all its features), or for this machine's CPU."""
    host = {"kind": "llvm", "mcpu": mcpu} if mcpu else host_llvm()
    if kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": cuda_arch}, host=host)
    return tvm.target.Target(host)


def specialize(mod: tvm.IRModule, bucket: AnyBucket) -> tvm.IRModule:
    """Bind the symbolic (batch, seq) of `main` to a bucket's static shape; a packed bucket binds
    only seq (any number of sequences and tokens: both stay symbolic)."""
    dims = symbolic_dims(mod)
    bound = {dims["batch"]: bucket.batch} if isinstance(bucket, Bucket) else {}
    bound[dims["seq"]] = bucket.seq
    return specialize_te_kernels(relax.transform.BindSymbolicVars(bound)(mod))


def relax_pipeline(target: tvm.target.Target, kernels: KernelConfig, tuned=None) -> tvm.transform.Pass:
    """CPU: the default fusing pipeline plus our CPU schedules (and `tuned`'s kept ones, a
    MetaSchedule database), the kernels as `kernels` says; CUDA: the default (dlight) one.

    `tvm.compile` alone neither fuses nor schedules on CPU, so we always pass the pipeline.
    """
    if target.kind.name == "llvm":
        return cpu_pipeline(target, kernels, tuned)
    return relax.get_default_pipeline(target)


@functools.cache
def import_cuda_tensor_intrinsics() -> None:
    """Import the tensor-core intrinsics dlight tensorises fp16 matmuls with, quickly.

    TVM 0.27's TVMScript decorator calls `inspect.stack()` for each of the ~100 functions in
    that module; for every frame of a pseudo-file (`<frozen importlib._bootstrap>`, `<string>`)
    `inspect.getmodule` then scans all of `sys.modules`. With torch loaded that took 150 s on the
    first fp16 bucket; with those pseudo-files mapped to a module for the import, 5 s.
    """
    pseudo_files = {"<frozen importlib._bootstrap>": "importlib._bootstrap",
                    "<frozen importlib._bootstrap_external>": "importlib._bootstrap_external",
                    "<string>": "builtins", "<ast>": "builtins"}
    added = {name: module for name, module in pseudo_files.items() if name not in inspect.modulesbyfile}
    inspect.modulesbyfile.update(added)
    try:
        import tvm.s_tir.tensor_intrin.cuda  # noqa: F401  (registers the intrinsics)
    finally:
        for name in added:
            inspect.modulesbyfile.pop(name, None)


def build_library(mod: tvm.IRModule, target: tvm.target.Target, path: Path, cuda_graph: bool = False,
                  tuned=None, kernels: KernelConfig | None = None) -> None:
    """Build and export one library; `cuda_graph` captures its static-shape kernels as a CUDA graph;
    `tuned` (CPU) replaces hand schedules with the tuned ones it holds; `kernels` (CPU) is what its
    kernels are written for (default: the target's, attention's products in fp32)."""
    if target.kind.name == "cuda":
        import_cuda_tensor_intrinsics()
    kernels = kernels or KernelConfig.of(target)
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": cuda_graph}):
        with target:  # as tvm.compile runs a Relax pipeline
            lowered = relax_pipeline(target, kernels, tuned)(mod)
        executable = tvm.compile(lowered, target, relax_pipeline=None, tir_pipeline=tir_pipeline(target))
    # the C objects defining what its kernels call (compile/kernels/linking.py)
    executable.export_library(str(path), addons=linked_objects(lowered, kernels.capabilities.int8_kernel))
