"""Whole-K micro-kernel calls over weight panels: what the bf16 (AVX-512) and AMX tiles share.

A tile kernel is C (the code generator cannot express their instructions, see kernels/bf16.py and
kernels/amx.py) called once per `rows` x `panel` output block with the block's whole K: the TIR
loop nest around it (parallel over panels, rows padded to the tile, an accumulator in a stack
buffer, the epilogue fused on write-back) is `schedule_tiles`, the call a tensor intrinsic
(`tile_intrinsic`) whose description is the loop nest it replaces, so tensorize checks the match.
The description includes the reduction's init: the kernel writes its block (`c = a x b`), never
reads it, so its accumulators start at zero in registers or tiles, not from memory just zeroed
(an AMX tile load of lines just stored stalls: 20% of a 32 x 32 x 384 call). Tensorize keeps the
matched block's init all the same (LLVM makes it a memset of the block before each call, 2% of
perf's samples in a bf16 MiniLM call at 512 tokens; dropping it measured within noise end to end),
so `schedule_tiles` drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers
from tvm.script import tirx as T

from . import script
from .common import parallelize_leftovers
from .fallback import vectorize_inner
from .launch import claim_grain, claim_iterations


@dataclass(frozen=True)
class Tile:
    """One whole-K micro-kernel: `rows` x `panel` accumulators over a K that is a multiple of
    `k_step`, reading activations `[rows, K]` and weight panels `[K / group, panel, group]`."""

    symbol: str
    rows: int
    panel: int
    group: int  # k values per panel element group (bf16: a pair, int8: a quad)
    k_step: int  # the K one pass of its loop consumes
    activation: str
    weight: str
    accumulator: str
    row_block: int = 0  # where set, activations are read in blocks of row_block rows x k_step (`blocked`)

    def fits(self, k_size) -> bool:
        return isinstance(k_size, (int, tirx.IntImm)) and int(k_size) % self.k_step == 0


def blocked(tile: Tile, rows, k):
    """Where activation (rows, k) lies in a tile's blocked layout `[M / row_block][K / k_step][row_block][k_step]`:
    each block one AMX tile's 16 rows of 64 bytes, contiguous, which a tile load reads as 16 lines in
    order (the rows of a row-major `[M, K]` are 16 lines a whole row apart, which the hardware prefetcher
    does not follow: measured on the 32 x 32 tile in C, the blocked layout took 0.80-0.95x the time at
    M = 512 and 128 with the 12 x 768 BERT's shapes; whole one-thread int8 calls of that model, paired
    against the row-major build, 0.94-0.96x at 128 and 512 tokens)."""
    block, step = tile.row_block, tile.k_step
    return rows // block, k // step, rows % block, k % step


def tile_intrinsic(tile: Tile, k_size: int) -> str:
    """The tensor intrinsic of one `tile` call over a K of `k_size` (registered on first use)."""
    name = f"{tile.symbol}_k{k_size}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, panel_tile(tile, k_size, computed=True), panel_tile(tile, k_size, computed=False))
    return name


def pad_rows_and_inline_panels(sch: s_tir.Schedule, main, rows: int, panel_view: str) -> list:
    """The matmul block's (m, n, k) loops once a symbolic or ragged M is padded to a multiple of
    `rows` (`pad_einsum`) and the weight's panel view (named `panel_view`) inlined, which
    `pad_einsum` needs done after it: it reads plain indices."""
    m = sch.get_loops(main)[0]
    extent = sch.get(m).extent
    if not (isinstance(extent, tirx.IntImm) and int(extent) % rows == 0):
        sch.pad_einsum(main, [rows, 1, 1])
    for producer in sch.get_producers(main):
        if sch.get(producer).name_hint.startswith(panel_view):
            sch.compute_inline(producer)
    return sch.get_loops(main)


def _widened(value, dtype: str):
    """An operand as the TE kernels read it: a bf16 bit pattern as fp32 (its upper half), bytes as int32."""
    if dtype == "uint16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", value), T.uint32(16)))
    return T.Cast("int32", value)


def panel_tile(tile: Tile, k_size: int, computed: bool) -> tirx.PrimFunc:
    """A tile's description (`computed`: the loop nest tensorize matches) or its implementation (the
    micro-kernel's call): one signature, so the two cannot drift apart."""
    groups = k_size // tile.group
    rows, panel, group = T.int64(tile.rows), T.int64(tile.panel), T.int64(tile.group)
    is_blocked = bool(tile.row_block)
    if is_blocked:
        shape = (*blocked(tile, rows, T.int64(k_size))[:2], T.int64(tile.row_block), T.int64(tile.k_step))
    else:
        shape = (rows, T.int64(k_size))

    def whole(A):
        return A[tuple(slice(0, extent) for extent in shape)]

    def read(A, i, k):
        return A[blocked(tile, i, k)] if is_blocked else A[i, k]

    def call(C, ldc, A, lda, B):
        row_stride = () if is_blocked else (T.Cast("int64", lda),)  # blocked activations have none
        return T.call_extern("int32", tile.symbol, C.access_ptr("w"), T.Cast("int64", ldc), A.access_ptr("r"),
                             *row_stride, B.access_ptr("r"), T.int64(groups))

    @script.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle, c: T.handle) -> None:
        lda = T.int64()
        ldc = T.int64()
        A = T.match_buffer(a, shape, tile.activation, offset_factor=1,
                           strides=None if is_blocked else [lda, 1])
        B = T.match_buffer(b, (T.int64(groups), panel, group), tile.weight, offset_factor=1)
        C = T.match_buffer(c, (rows, panel), tile.accumulator, offset_factor=1, strides=[ldc, 1])
        with T.sblock("root"):
            T.reads(whole(A), B[0:groups, 0:panel, 0:group])
            T.writes(C[0:rows, 0:panel])
            if computed:
                for i, j, ko, ki in T.grid(rows, panel, T.int64(groups), group):
                    with T.sblock("update"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        vk = T.axis.reduce(T.int64(k_size), ko * group + ki)
                        T.reads(C[vi, vj], read(A, vi, vk), B[vk // group, vj, vk % group])
                        T.writes(C[vi, vj])
                        with T.init():
                            C[vi, vj] = T.cast(0, tile.accumulator)
                        C[vi, vj] = C[vi, vj] + _widened(read(A, vi, vk), tile.activation) * _widened(
                            B[vk // group, vj, vk % group], tile.weight)
            else:
                T.evaluate(call(C, ldc, A, lda, B))

    return func


def schedule_tiles(sch: s_tir.Schedule, main, tile: Tile, panel_view: str, lanes: int = 16) -> s_tir.Schedule:
    """Schedule the matmul block `main` (reading its weight through the inlinable `panel_view`) and
    its fused epilogue as whole-K calls of `tile`:

        x' = x in the tile's blocked layout (`blocked`), where the tile reads one (AMX)
        parallel (N / panel, claimed by the threads as they come free: launch.claim_iterations):
          for M / rows:
            micro-kernel: acc[rows, panel] = x[rows, :] @ panel     (the whole K loop)
            y[rows, panel] = epilogue(acc)
    A symbolic or ragged M is padded to a multiple of `rows` (`pad_einsum`).
    """
    m, j, k = pad_rows_and_inline_panels(sch, main, tile.rows, panel_view)
    if tile.row_block:
        _block_activations(sch, main, tile)
    k_size = int(sch.get(k).extent)
    jo, ji = sch.split(j, [None, tile.panel])
    mo, mi = sch.split(m, [None, tile.rows])
    ko, ki = sch.split(k, [None, tile.group])
    sch.reorder(jo, mo, mi, ji, ko, ki)
    sch.parallel(jo)
    acc = sch.cache_write(main, 0, "global")  # at most 4 KB: a stack alloca (compile/lowering.py)
    sch.reverse_compute_at(acc, mo, preserve_unit_loops=True)
    auto_inline_consumers(sch, acc)
    vectorize_inner(sch, acc, lanes)
    call = sch.blockize(mi)
    sch.tensorize(call, tile_intrinsic(tile, k_size))
    _drop_init(sch, call)
    parallelize_leftovers(sch)
    grain = claim_grain(sch.get(mo).extent * tile.rows * tile.panel * k_size)
    return s_tir.Schedule(claim_iterations(sch.mod["main"], grain, sch.get(jo).loop_var))


def _block_activations(sch: s_tir.Schedule, main, tile: Tile) -> None:
    """Have the copy of the activations the matmul `main` reads (the padded one `pad_einsum` wrote, else
    a new one) write them in the tile's blocked layout (`blocked`): where the rows were padded this
    costs nothing more; where not, one copy of the activations against a GEMM that reads them N / panel
    times."""
    activations = sch.get(main).reads[0].source
    copies = [block for block in sch.get_producers(main) if sch.get(block).writes[0].source.same_as(activations)]
    copy = copies[0] if copies else sch.cache_read(main, 0, "global")
    sch.transform_layout(copy, ("write", 0), lambda rows, k: blocked(tile, rows, k))
    _, k = sch.get_loops(copy)
    sch.vectorize(sch.split(k, [None, tile.k_step])[1])  # one block row: 64 bytes


def _drop_init(sch: s_tir.Schedule, call) -> None:
    """Remove the tensorized `call` block's init: the tile writes every element of its block."""
    block = sch.get(call)
    bare = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body, None,
                        block.alloc_buffers, block.match_buffers, block.annotations)
    sch.state.replace(sch.get_sref(call), bare, {block: bare})
