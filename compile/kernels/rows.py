"""Row kernels for CPUs: softmax, layer norm, and any kernel that reduces and rewrites each row of a
[rows, width] tensor independently (the int8 row quantizer has a kernel of its own, row_quantize.py).

Each is one parallel loop over rows (one launch of the thread pool, where TVM's default lowering
and dlight's CPU `Reduction` rule launch once per block) and, inside, every step of a row: its
reductions (sum, max, variance) split into 16 partial results (`REDUCTION_PARTIALS`, or `lanes`) that
one or two vector instructions update at a time (`rfactor`) instead of a scalar chain of `width`
dependent adds, and its
element-wise steps vectorised. Injective producers with one consumer are recomputed where they
are read (the mask and scale before a softmax); a
step read twice (softmax's exp, layer norm's mean) is computed once per row.

It applies when the row width is static and a multiple of the lanes (every hidden size, every
sequence bound); anything else is left to the next rule.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .common import attempt, is_reduction, root_blocks, static_extent

# Partial results per reduction over a row: at least 16, so that each partial's chain of dependent
# adds is width / 16 long whatever the vector width (one zmm, two ymm); with one ymm of partials an
# x86-64-v3 layer norm took twice the AVX-512 one's time, waiting on that chain.
REDUCTION_PARTIALS = 16


def _partials(width: int, lanes: int) -> int:
    partials = max(lanes, REDUCTION_PARTIALS)
    return partials if width % partials == 0 else lanes


def schedule_rows(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    sch = s_tir.Schedule(func)
    blocks = root_blocks(sch)
    if len(blocks) < 2 or not any(is_reduction(sch, block) for block in blocks):
        return None
    for block in blocks[:-1]:  # single-use injective steps are recomputed where they are read
        if not is_reduction(sch, block) and len(sch.get_consumers(block)) == 1:
            attempt(sch.compute_inline, block)
    output = root_blocks(sch)[-1]
    if not is_reduction(sch, output) and len(sch.get_producers(output)) == 1:
        producer = sch.get_producers(output)[0]
        if not is_reduction(sch, producer) and attempt(sch.reverse_compute_inline, output):
            output = producer  # a trailing copy (softmax's broadcast) folded into its producer
    blocks = root_blocks(sch)
    loops = sch.get_loops(output)
    rows = len(loops) - 1
    width = static_extent(sch, loops[-1]) if rows else None
    if not rows or width is None or width % lanes or is_reduction(sch, output):
        return None
    for block in blocks[:-1]:  # every step iterates the output's rows, then at most the row's width
        own = sch.get_loops(block)
        if len(own) not in (rows, rows + 1) or (len(own) == rows + 1 and static_extent(sch, own[-1]) != width):
            return None
    partials = []
    for block in blocks[:-1]:  # reductions over the width: `_partials` partial results each
        own = sch.get_loops(block)
        if is_reduction(sch, block) and len(own) == rows + 1:
            _, inner = sch.split(own[-1], [None, _partials(width, lanes)])
            partials.append(sch.rfactor(inner, factor_axis=0))
    # the rows' loop is the first output's (compute_at cannot move an output block, so outputs
    # after it, a second output of a fused kernel, are moved under it the other way round)
    outputs = [sch.get(block) for block in sch.get_output_blocks(sch.get_sblock("root"))]
    ordered = root_blocks(sch)
    position = next(index for index, block in enumerate(ordered) if any(sch.get(block).same_as(o) for o in outputs))
    anchor = ordered[position]
    loops = sch.get_loops(anchor)[:rows]
    row = sch.fuse(*loops) if rows > 1 else loops[0]
    sch.parallel(row)
    for block in reversed(ordered[:position]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    for block in ordered[position + 1:]:
        sch.reverse_compute_at(block, row, preserve_unit_loops=True)
    for partial in partials:
        outer, inner = sch.get_loops(partial)[-2:]
        init = sch.decompose_reduction(partial, outer)
        # `vectorize` refuses a reduction's update; unrolled, its `lanes` independent updates of
        # contiguous partials are what LLVM's SLP vectoriser turns into one vector instruction
        sch.unroll(inner)
        sch.vectorize(sch.get_loops(init)[-1])
    for block in root_blocks(sch):
        own = sch.get_loops(block)
        if not is_reduction(sch, block) and static_extent(sch, own[-1]) == width and len(own) > 1:
            _, inner = sch.split(own[-1], [None, lanes])
            sch.vectorize(inner)
    return sch
