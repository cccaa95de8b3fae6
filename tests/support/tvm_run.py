"""TVM functions built and run in tests, one way each: a Relax module through TVM's default
pipeline (the reference a rewrite is checked against) or through the compile stage's CPU pipeline
(as the libraries are built), a TIR kernel lowered as the libraries' are, and each run on numpy
arrays; and whether this CPU may run code built for a target (code generation is checked on any
host, numbers where the code runs)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from artifact.cpu_features import missing_on_host, target_features
from compile.capabilities import cpu_name
from compile.lowering import tir_pipeline
from compile.schedule import cpu_pipeline

LLVM = tvm.target.Target({"kind": "llvm"})  # no CPU named: TVM's generic x86-64 code, which runs anywhere


def build_reference(mod: tvm.IRModule, target: tvm.target.Target = LLVM) -> tvm.runtime.Executable:
    """`mod` through TVM's default Relax pipeline (legalize and fuse, no schedules of ours)."""
    return tvm.compile(mod, target, relax_pipeline=relax.get_default_pipeline(target))


def build_scheduled(mod: tvm.IRModule, target: tvm.target.Target, **options) -> tvm.runtime.Executable:
    """`mod` through the compile stage's CPU pipeline (compile.schedule.cpu_pipeline with `options`)
    and TIR lowering, as its libraries are built."""
    return tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target, **options), tir_pipeline=tir_pipeline(target))


def build_kernel(kernel, target: tvm.target.Target) -> tvm.runtime.Executable:
    """A TIR kernel (a PrimFunc, a schedule's module or an IRModule of PrimFuncs) lowered as the
    libraries' kernels are; a lone PrimFunc is the library's `main`."""
    if isinstance(kernel, tvm.tirx.PrimFunc):
        kernel = tvm.IRModule({"main": kernel})
    return tvm.compile(kernel, target, tir_pipeline=tir_pipeline(target))


def _numpy(value):
    return value.numpy() if hasattr(value, "numpy") else [_numpy(item) for item in value]


def run(built, *arrays: np.ndarray):
    """`main` of a built (or loaded) Relax module on this CPU: its output as numpy, a list of them
    where it returns a tuple."""
    return _numpy(relax.VirtualMachine(built, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in arrays)))


def call_kernel(library, inputs: list[np.ndarray], outputs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """`main` of a built (or loaded) TIR kernel on `inputs`, writing zero-filled outputs of the given
    (shape, dtype): those outputs as numpy."""
    results = [tvm.runtime.tensor(np.zeros(shape, dtype)) for shape, dtype in outputs]
    library["main"](*(tvm.runtime.tensor(a) for a in inputs), *results)
    return [result.numpy() for result in results]


def missing_here(target: tvm.target.Target) -> list[str]:
    """The features code for `target` may use that this CPU lacks (none where its flags cannot be read)."""
    return missing_on_host(target_features(target)) or []


def runs_here(target: tvm.target.Target) -> bool:
    """Whether this CPU may run code built for `target`."""
    return not missing_here(target)


def skip_unless_runs_here(target: tvm.target.Target) -> None:
    """Skip the rest of a test (which has built for `target`) where this CPU cannot run the code."""
    missing = missing_here(target)
    if missing:
        # reported at the test, as a skip mark is, not at this line
        raise pytest.skip.Exception(f"compiled for {cpu_name(target)}; this CPU lacks {', '.join(missing)}, so it is "
                                    "not run", _use_item_location=True)
