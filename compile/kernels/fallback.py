"""The fallback schedule: whatever no kernel family recognises still runs in parallel and vectorised
(TVM 0.27's default CPU lowering leaves it serial and scalar)."""

from __future__ import annotations

from tvm import s_tir, tirx

from .common import attempt, is_reduction, root_blocks, static_extent


def vectorize_inner(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorise the innermost loop of `block` by `lanes` when its extent allows it."""
    loop = sch.get_loops(block)[-1]
    size = static_extent(sch, loop)
    if size is None or size < 2:
        return
    if size <= lanes:
        attempt(sch.vectorize, loop)
    elif size % lanes == 0:
        _, inner = sch.split(loop, [None, lanes])
        attempt(sch.vectorize, inner)


def parallel_vectorize(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorise a spatial innermost loop, and run the loops above it as one parallel loop.

    A reduction block keeps its reduction loops serial: only its leading spatial loops are fused
    and parallelised, so each task owns whole output elements and needs no atomic update. The
    runtime hands each thread one contiguous chunk of the fused loop, so fine iterations are fine.
    """
    iter_types = [iv.iter_type for iv in sch.get(block).iter_vars]
    if not iter_types or len(sch.get_loops(block)) != len(iter_types):
        return  # not the trivial one-loop-per-block-var nest LegalizeOps writes; leave it
    if all(t == tirx.IterVar.DataPar for t in iter_types):
        vectorize_inner(sch, block, lanes)
        loops = sch.get_loops(block)
        outer = [loop for loop in loops if sch.get(loop).kind != tirx.ForKind.VECTORIZED]
        if len(outer) == len(loops) > 1:
            # A symbolic innermost loop stays out of the fused loop: fusing it would recover every
            # element's indices with a division by a runtime extent (3-9x slower on softmax-sized
            # kernels), and kept whole LLVM can still vectorise it.
            outer = outer[:-1]
    else:
        loops = sch.get_loops(block)
        outer = []
        for loop, kind in zip(loops, iter_types):
            if kind != tirx.IterVar.DataPar:
                break
            outer.append(loop)
    if outer:
        attempt(sch.parallel, sch.fuse(*outer) if len(outer) > 1 else outer[0])


def schedule_fallback(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    """Inline injective blocks, then parallelise + vectorise every remaining block."""
    sch = s_tir.Schedule(func)
    blocks = root_blocks(sch)
    if not blocks:
        return None
    for block in blocks[:-1]:  # the last block writes the output and cannot be inlined
        if not is_reduction(sch, block):
            attempt(sch.compute_inline, block)
    for block in root_blocks(sch):
        parallel_vectorize(sch, block, lanes)
    return sch
