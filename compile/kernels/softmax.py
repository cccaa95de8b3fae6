"""A CPU schedule for attention's softmax rows: vectorised reductions instead of scalar chains.

dlight's CPU `Reduction` rule runs each row's max and sum as one scalar loop: a dependency chain
of `seq` adds, a few cycles each, for every one of heads x seq rows. Here both reductions are split by the vector width and `rfactor`ed into
`lanes` partial results that one vector instruction updates at a time, then folded; the exp and
the normalisation are vectorised, all per row, rows in parallel.

It applies to LegalizeOps' softmax blocks (with whatever FuseOps put around them) over a static
last axis that the vector width divides (every sequence bound); anything else is left to the
next rule.
"""

from __future__ import annotations

from tvm import s_tir, tirx

SOFTMAX_BLOCKS = ("T_softmax_maxelem", "T_softmax_exp", "T_softmax_expsum", "T_softmax_norm")


def schedule_softmax(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    sch = s_tir.Schedule(func)
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    by_name = {sch.get(block).name_hint: block for block in blocks}
    if not all(name in by_name for name in SOFTMAX_BLOCKS):
        return None
    maxelem, exp, expsum, norm = (by_name[name] for name in SOFTMAX_BLOCKS)
    width = sch.get(sch.get_loops(maxelem)[-1]).extent
    if not (isinstance(width, tirx.IntImm) and int(width) % lanes == 0):
        return None
    for block in blocks:  # FuseOps' producers (the scale, the mask) are recomputed per row
        if sch.get(block).name_hint not in SOFTMAX_BLOCKS and block != blocks[-1]:
            sch.compute_inline(block)
    if not sch.get(blocks[-1]).same_as(sch.get(norm)):
        sch.reverse_compute_inline(blocks[-1])  # its consumer (a broadcast copy) into the normalisation
    partials = []
    for reduction in (maxelem, expsum):  # `lanes` partial results per row, then folded
        _, inner = sch.split(sch.get_loops(reduction)[-1], [None, lanes])
        partials.append(sch.rfactor(inner, factor_axis=0))
    loops = sch.get_loops(norm)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    sch.parallel(row)
    for block in (expsum, partials[1], exp, maxelem, partials[0]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    for partial in partials:
        outer, inner = sch.get_loops(partial)[-2:]
        init = sch.decompose_reduction(partial, outer)
        # `vectorize` refuses a reduction's update; unrolled, its `lanes` independent updates of
        # contiguous partials are what LLVM's SLP vectoriser turns into one vector instruction
        sch.unroll(inner)
        sch.vectorize(sch.get_loops(init)[-1])
    for block in (exp, norm):
        _, inner = sch.split(sch.get_loops(block)[-1], [None, lanes])
        sch.vectorize(inner)
    return sch
