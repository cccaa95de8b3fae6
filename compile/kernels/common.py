"""What every CPU kernel schedule here shares: small helpers over `s_tir.Schedule`."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

SCHEDULED_ATTR = "tirx.is_scheduled"  # a PrimFunc the CPU schedule pass must leave as it is


def prescheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func`, written already scheduled: the schedule pass leaves it, and FuseOps fuses nothing
    into it (relax OpPatternKind::kOpaque)."""
    return func.with_attrs({SCHEDULED_ATTR: True, "op_pattern": 8})


def without_param(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """`func` without the buffer parameter `name`, which its body does not read: one written kernel
    for variants whose signatures differ by an optional input."""
    return tirx.PrimFunc([p for p in func.params if p.name != name], func.body, func.ret_type, func.attrs)


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


def prefetch_next_panel(func: tirx.PrimFunc, k_var: tirx.Var, tile_var: tirx.Var, panels: tirx.Buffer,
                        rows_var: tirx.Var | None = None, steps: int = 1) -> tirx.PrimFunc:
    """`func` with step k of the next weight panel prefetched into L2 at step k of the k loop of the
    panel's first tile of rows (`rows_var` 0; of every k loop without it), `steps` of them at each
    iteration of a k loop unrolled by that many (`dense._unrolled_steps`). The later tiles find it
    there, and their prefetches only took load slots from the products: issued by the first tile
    alone, MiniLM's x86-64-v3 int8 calls at 128-512 tokens took 0.96x the time, its x86-64-v3 and
    x86-64-v4 fp32 calls 0.97-1.01x, 16-token calls the same within noise (docs/experiments/first-tile-prefetch.md).

    `panels` is `[count, steps, *row]`, each panel's rows contiguous, a row per step of the k loop
    (fp32: `[N / nt, K, nt]`; int8: `[N / panel, K / group, panel, group]`). The hardware prefetcher
    follows the panel being read but cannot know which one comes next, so at small M (one or two M
    tiles per panel) each panel starts with a stall on memory, and the weights stream from DRAM
    (MiniLM's 42 MB of fp32 linears exceed a 32 MB L3): with it a 16-token fp32 call of the whole
    model went from 0.88x to 0.82x ONNX Runtime's time (int8: docs/experiments/exp-and-int8-panels.md).
    The parallel loop's index is (batch..., panel) fused, so the next panel is tile + 1 modulo the
    panel count (the last one's prefetch is wasted). The accumulator must then be a stack alloca
    (compile/lowering.py), or LLVM spills it every step.
    """
    count, row = int(panels.shape[0]), [int(d) for d in panels.shape[2:]]
    dtype = tvm.runtime.DataType(panels.dtype)
    per_line = 64 * 8 // dtype.bits  # elements of one 64-byte cache line
    row_size = 1
    for extent in row:
        row_size *= extent
    next_panel = tirx.floormod(tile_var + 1, count)

    def row_index(offset: int) -> list[tirx.IntImm]:
        index = []
        for extent in reversed(row):
            index.append(tirx.IntImm("int64", offset % extent))
            offset //= extent
        return index[::-1]

    def add_prefetch(loop: tirx.For):
        if not loop.loop_var.same_as(k_var):
            return loop
        step = k_var * tirx.IntImm(k_var.ty.dtype, steps)
        lines = [tirx.Evaluate(tirx.call_intrin(
            "void", "tirx.prefetch",
            tirx.address_of(tirx.BufferLoad(panels, [next_panel, step + offset // row_size,
                                                     *row_index(offset % row_size)])),
            0, 2, 1)) for offset in range(0, steps * row_size, per_line)]  # read, L2 (locality 2), data cache
        prefetches = lines[0] if len(lines) == 1 else tirx.SeqStmt(lines)  # a panel step of one line: no sequence
        if rows_var is not None:
            prefetches = tirx.IfThenElse(tirx.EQ(rows_var, tirx.const(0, str(rows_var.ty.dtype))), prefetches, None)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.SeqStmt([prefetches, loop.body]),
                        loop.thread_binding, loop.annotations)

    return tvm_ffi.structural_map(func, [(tirx.For, add_prefetch)])


def read_padded_rows_in_place(func: tirx.PrimFunc, copy: tirx.Buffer) -> tirx.PrimFunc:
    """`func` without `copy`, the zero-padded copy `pad_einsum` made of a matmul's activations: each
    read of it (a load, a block's read region, a micro-kernel's match buffer) reads the activations
    themselves, every padded axis clamped to its last index (`A[min(i, M - 1), k]`). That saves a
    pass over the activations and a thread-pool launch per call, and the hot loop gets no branch.
    A padded row feeds only its own output row, which the write-back drops, so its values never
    matter. A reader of several rows of a padded axis at once (a tile kernel's row block) could
    read past the end clamped so: `func` then keeps its copy.
    """
    blocks = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, blocks.append)])
    copies = [block for block in blocks if len(block.writes) == 1 and block.writes[0].source.same_as(copy)]
    if len(copies) != 1:
        return func
    (copy_block,) = copies
    source = copy_block.reads[0].source
    padded = [axis for axis, (a, b) in enumerate(zip(copy.shape, source.shape)) if not tvm_ffi.structural_equal(a, b)]
    reads = [region for block in blocks if not block.same_as(copy_block)
             for region in [*block.reads, *(match.source for match in block.match_buffers)]
             if region.source.same_as(copy)]
    if any(not (isinstance(extent, tirx.IntImm) and extent.value == 1)
           for extent in (region.region[axis].extent for region in reads for axis in padded)):
        return func

    def clamped(indices):
        return [tirx.min(index, source.shape[axis] - 1) if axis in padded else index
                for axis, index in enumerate(indices)]

    def is_no_op(stmt) -> bool:
        return isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tirx.IntImm)

    def drop_copy(realize: s_tir.SBlockRealize):
        return tirx.Evaluate(0) if realize.block.same_as(copy_block) else realize

    def drop_empty_loop(loop: tirx.For):  # the copy's loop nest, emptied from the inside out
        return loop.body if is_no_op(loop.body) else loop

    def drop_no_ops(seq: tirx.SeqStmt):
        kept = [stmt for stmt in seq.seq if not is_no_op(stmt)]
        if len(kept) == len(seq.seq):
            return seq
        return tirx.SeqStmt(kept) if len(kept) > 1 else kept[0] if kept else tirx.Evaluate(0)

    def unallocate(block: s_tir.SBlock):
        if not any(buffer.same_as(copy) for buffer in block.alloc_buffers):
            return block
        return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body, block.init,
                            [buffer for buffer in block.alloc_buffers if not buffer.same_as(copy)],
                            block.match_buffers, block.annotations)

    def load(node: tvm.ir.expr.TensorLoad):
        return tirx.BufferLoad(source, clamped(node.indices)) if node.source.same_as(copy) else node

    def region(node: tvm.ir.expr.TensorRegion):
        if not node.source.same_as(copy):
            return node
        starts = clamped([r.min for r in node.region])
        return tirx.BufferRegion(source, [tvm.ir.Range.from_min_extent(start, r.extent)
                                          for start, r in zip(starts, node.region)])

    func = tvm_ffi.structural_map(func, [(s_tir.SBlockRealize, drop_copy), (tirx.For, drop_empty_loop),
                                         (tirx.SeqStmt, drop_no_ops)])
    return tvm_ffi.structural_map(func, [(s_tir.SBlock, unallocate), (tvm.ir.expr.TensorLoad, load),
                                         (tvm.ir.expr.TensorRegion, region)])
