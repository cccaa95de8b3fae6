"""Relax modules as the compile stage's schedule pass sees them: legalized and fused into TIR kernels."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu

from compile.build import make_target


def cpu_target(mcpu: str | None = None) -> tvm.target.Target:
    """This CPU's target (or `mcpu`'s) with `num-cores` 2."""
    return tvm.target.Target({**make_target("cpu", mcpu=mcpu).export(), "num-cores": 2})


def fused(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """`mod` through TVM's CPU legalize-and-fuse passes: the kernels the schedule pass then schedules."""
    with target:
        return tvm.transform.Sequential(cpu.legalize_passes(target))(mod)


def prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The TIR kernels of `mod` by name."""
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def compacted_allocations(func: tirx.PrimFunc) -> list[str]:
    """The allocations of `func` (lines of its script) once lowering has shrunk each to the region its
    users touch."""
    compacted = tvm.transform.Sequential([s_tir.transform.LowerInitBlock(),
                                          s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                                          s_tir.transform.ConvertBlocksToOpaque(),
                                          s_tir.transform.CompactBufferAllocation()])(tvm.IRModule({"main": func}))
    return [line for line in compacted.script().splitlines() if "alloc_buffer" in line]


def random_floats(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard normal float32 values of `shape`, seeded by the seed and the shape."""
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype("float32")
