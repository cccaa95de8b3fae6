"""What every CPU kernel schedule here shares: the host's vector width and small helpers over
`s_tir.Schedule`."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features

SCHEDULED_ATTR = "tirx.is_scheduled"  # a PrimFunc the CPU schedule pass must leave as it is


def prescheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func`, written already scheduled: the schedule pass leaves it, and FuseOps fuses nothing
    into it (relax OpPatternKind::kOpaque)."""
    return func.with_attrs({SCHEDULED_ATTR: True, "op_pattern": 8})


def without_param(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """`func` without the buffer parameter `name`, which its body does not read: one written kernel
    for variants whose signatures differ by an optional input."""
    return tirx.PrimFunc([p for p in func.params if p.name != name], func.body, func.ret_type, func.attrs)


def vector_lanes(target: Target) -> int:
    """fp32 lanes of one SIMD register: 16 with AVX-512, 8 with AVX2, else 4 (SSE / NEON).

    `llvm_get_vector_width` is no help here: it answers 512 even for AVX2-only CPUs.
    """
    if target.kind.name != "llvm":
        return 4
    if llvm_cpu_has_features("avx512f", target):
        return 16
    if llvm_cpu_has_features("avx2", target):
        return 8
    return 4


def static_extent(sch: s_tir.Schedule, loop) -> int | None:
    """A loop's extent as an int, or None when it is symbolic."""
    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def root_blocks(sch: s_tir.Schedule) -> list:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def parallelize_leftovers(sch: s_tir.Schedule) -> None:
    """Run on the pool, too, the blocks a matmul schedule leaves outside its parallel nest (the
    padded copy of the activations, the un-padding of the output)."""
    for block in root_blocks(sch):
        loops = sch.get_loops(block)
        if loops and sch.get(loops[0]).kind != tirx.ForKind.PARALLEL:
            sch.parallel(loops[0])


def attempt(fn, *args) -> bool:
    """Apply one optional schedule primitive; a refusal leaves the schedule as it was.

    TVM 0.27 raises `ScheduleError` / `InternalError`, both RuntimeErrors, and has no TVMError.
    """
    try:
        fn(*args)
        return True
    except (RuntimeError, ValueError):
        return False
