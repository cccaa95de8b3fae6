"""The fp32 dense kernel family for CPUs: a linear over weights packed in panels, and the
register-blocked schedule every matmul-shaped PrimFunc (linears, attention's batch matmuls) gets.

`packed_matmul_te` writes `x @ W^T` over weights packed at compile time (compile/passes/packing.py)
in the panels `schedule_matmul` streams; `schedule_matmul` schedules any
C[S, I, J] += A[S, I, K] * B[S, J, K] with its injective epilogue (bias, GELU, residual add).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, te, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers

from .common import is_reduction, prefetch_next_panel, read_padded_rows_in_place, root_blocks, static_extent
from .fallback import parallel_vectorize, vectorize_inner
from .launch import claim_grain, claim_iterations

KERNEL_NAME = "packed_matmul"
PANEL_VIEW = "panel_view"  # the block the kernel reads packed weights through (inlined by the schedule)


def packed_matmul_te(x: te.Tensor, packed: te.Tensor) -> te.Tensor:
    """y[M, N] = x[M, K] @ W^T with W given as Wp[N / nt, K, nt] (Wp[j // nt, k, j % nt] = W[j, k]).

    W^T is first written as an (inlinable) view of the panels, so the matmul block itself is a
    plain einsum the schedule can pad (symbolic M); the schedule then inlines the view.
    """
    panels, k_size, nt = (int(d) for d in packed.shape)
    weight = te.compute((_i64(panels * nt), _i64(k_size)), lambda j, kk: packed[j // nt, kk, j % nt],
                        name=PANEL_VIEW)
    k = te.reduce_axis((0, _i64(k_size)), name="k")
    return te.compute((x.shape[0], _i64(panels * nt)), lambda m, j: te.sum(x[m, k] * weight[j, k], axis=k),
                      name=KERNEL_NAME)


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)  # Relax shapes are int64; the kernel's buffers must match them


def _tile_sizes(n: int | None, lanes: int) -> tuple[int, int, bool]:
    """(mt, nt, pad_n): the register tile and whether N must be padded to a multiple of nt.

    The mt x nt accumulator must fit the register file with room for the B vectors and one A
    broadcast: AVX2 has 16 ymm -> 4 x 24 (12 accumulators, measured best of 4x16, 4x24, 6x16,
    8x16 here); AVX-512 has 32 zmm -> 8 x 48 (24 accumulators, 3 B vectors and 8 broadcasts per 24
    FMAs, where 8 x 32 took 2 and 8 per 16: MiniLM's linears at 128-512 tokens in 0.90-0.96x its
    time on an Intel Xeon, docs/experiments/dense-tile-avx512.md; 4 x 64, 6 x 64 and 12 x 32 were slower there).
    nt is the widest candidate dividing a static N, so the N tail needs no padding; otherwise N
    is padded to 2 vectors (1 vector when N is that small).
    """
    mt = 8 if lanes >= 16 else 4
    candidates = [3 * lanes, 2 * lanes, lanes]
    for nt in candidates:
        if n is not None and n % nt == 0:
            return mt, nt, False
    return mt, (lanes if n is not None and n < 2 * lanes else 2 * lanes), True


def _unrolled_steps(k: int | None) -> int:
    """Steps of the k loop (of `k`, None: symbolic) unrolled into one iteration: 4, else 2, where they
    divide it. An AVX2 step is 12 multiply-adds, 3 loads and 4 broadcasts, and the loop's increments,
    compare and branch and the prefetch's test were 4 more instructions a step: unrolled by 4, MiniLM's
    x86-64-v3 linears took 0.88-0.99x the time in its calls at 16-512 tokens on 2 threads in a busy
    hour of a shared host, 0.97-1.03x in a quiet one, paired (docs/experiments/unrolled-k-loop.md). AVX-512's steps
    are twice the work; its linears took the same time. (The int8 kernels' steps unrolled so took
    1.01-1.10x.)"""
    return 1 if k is None else next(steps for steps in (4, 2, 1) if k % steps == 0)


def packed_panel_width(n: int, lanes: int) -> int | None:
    """The nt of the panels `schedule_matmul` would cut a weight of N columns into, or None when N
    needs padding (then the weight is better left unpacked)."""
    _, nt, pad_n = _tile_sizes(n, lanes)
    return None if pad_n else nt


def _panel_view(sch: s_tir.Schedule, block, nt: int):
    """The producer of `block`'s B operand that views weights packed in panels of width `nt`
    (W[j, k] = Wp[j // nt, k, j % nt], see compile/passes/packing.py), or None."""
    b_buffer = sch.get(block).reads[1].source
    for producer in sch.get_producers(block):
        stmt = sch.get(producer)
        if stmt.name_hint.startswith(PANEL_VIEW) and stmt.writes[0].source.same_as(b_buffer):
            index = stmt.body.value.indices[-1]
            if isinstance(index, tirx.FloorMod) and isinstance(index.b, tirx.IntImm) and int(index.b) == nt:
                return producer
    return None


def matmul_axes(block: s_tir.SBlock) -> list[str] | None:
    """Classify the block's iter vars for C[S, I, J] += A[S, I, K] * B[S, J, K], or None.

    Returns one letter per block iter: "S" batch (in A, B and C, or an outer axis of A and C),
    "I" (A and C), "J" (B and C), "K" (reduced, in A and B), "T" (extent 1, anywhere). Unlike dlight's
    `detect_iter_traits` an absent I axis is allowed (M = 1 is a trivial axis), so a bucket of 1 x 1 still matches.
    Every access index must be a single iter var or a constant (what `pad_einsum` accepts).
    """
    store = block.body
    if len(block.reads) != 2 or len(block.writes) != 1 or not isinstance(store, tirx.BufferStore):
        return None
    if not (isinstance(store.value, tvm.ir.prim.expr.Add) and isinstance(store.value.b, tvm.ir.prim.expr.Mul)):
        return None  # C = C + A * B; not a max or sum reduction that merely has two inputs
    accessed = []
    for region in (block.reads[0], block.reads[1], block.writes[0]):
        axes = set()
        for r in region.region:
            if not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1):
                return None
            if not isinstance(r.min, tirx.IntImm):
                if not isinstance(r.min, tirx.Var):
                    return None
                axes.add(r.min)
        accessed.append(axes)
    a, b, c = accessed
    kinds = []
    for iv in block.iter_vars:
        var, reduce = iv.var, iv.iter_type == tirx.IterVar.CommReduce
        if isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value == 1:
            kinds.append("T")
        elif reduce and var in a and var in b and var not in c:
            kinds.append("K")
        elif not reduce and var in c:
            kinds.append({(True, True): "S", (True, False): "I", (False, True): "J"}.get((var in a, var in b), "?"))
        else:
            return None
    if "?" in kinds or kinds.count("J") != 1 or kinds.count("K") != 1:
        return None
    # x[b, s, k] @ w[k, n]: b and s are both "I"; all but the innermost act as batch axes.
    last_i = max((p for p, kd in enumerate(kinds) if kd == "I"), default=-1)
    return ["S" if kd == "I" and p != last_i else kd for p, kd in enumerate(kinds)]


def schedule_matmul(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    """Schedule C[S, I, J] += A[S, I, K] * B[S, J, K] (any operand layout) plus its epilogue.

    Loop nest produced (S = batch axes, I = M, J = N, K = reduction):
        parallel (S, J / nt):                  # enough tasks for all cores even at M = 16, claimed
                                               # by the threads as they come free (launch.claim_iterations)
          B_pack[K, nt] = B[S, :, J tile]      # contiguous, and stays in L1/L2 for all of M
          for I / mt:
            acc[mt, nt] = 0
            for k / u:  prefetch its u rows of the next panel (packed weights, first I tile: `prefetch_next_panel`)
                    unrolled u steps (4 or 2 where they divide K: `_unrolled_steps`):
                        unrolled ii < mt:  vectorised ji < nt:  acc[ii, ji] += A[ii, k] * B_pack[k, ji]
            C[I tile, J tile] = epilogue(acc)  # bias, GELU, residual add, ... fused, vectorised
    Each B vector load feeds mt FMAs and each A broadcast nt / lanes FMAs. Symbolic or ragged M
    (and N) are padded with `pad_einsum`, so the hot loop has no bounds checks; A's padded rows are
    not copied but read clamped to its last row (`common.read_padded_rows_in_place`). M = 1 (an
    axis of extent 1 is "trivial" to the analysis) runs the same nest with mt = 1.
    """
    sch = s_tir.Schedule(func)
    reductions = [b for b in root_blocks(sch) if is_reduction(sch, b)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    kinds = matmul_axes(sch.get(main))
    if kinds is None:
        return None
    mt, nt, m, padded_n = _pad(sch, main, kinds, lanes)
    activations = sch.get(main).reads[0].source  # A's zero-padded copy when M is padded
    panel_view = None if padded_n else _panel_view(sch, main, nt)
    panels = None
    if panel_view is not None:  # read the packed panels directly: B[j, k] becomes Wp[j // nt, k, j % nt]
        sch.compute_inline(panel_view)
        panels = sch.get(main).reads[1].source
    loops = _split_loops(sch, main, kinds, mt, nt)
    if panel_view is None:
        _pack_weights(sch, main, kinds, loops.tile, m is None or m >= 8 * mt, lanes)
    _accumulate_in_registers(sch, main, loops, lanes)
    k_var, tile_var = sch.get(loops.k).loop_var, sch.get(loops.tile).loop_var
    k_extent = sch.get(loops.k).extent * loops.unroll_k
    rows_var = sch.get(loops.io).loop_var if loops.io is not None else None
    row_tiles = sch.get(loops.io).extent if loops.io is not None else 1

    # Whatever could not be fused (a padded copy of B, an epilogue the inliner refused) still
    # runs in parallel and vectorised.
    for block in root_blocks(sch):
        block_loops = sch.get_loops(block)
        if block_loops and sch.get(block_loops[0]).kind != tirx.ForKind.PARALLEL:
            parallel_vectorize(sch, block, lanes)
    func = read_padded_rows_in_place(sch.mod["main"], activations)
    if panels is not None:
        func = prefetch_next_panel(func, k_var, tile_var, panels, rows_var, loops.unroll_k)
    grain = claim_grain(row_tiles * mt * nt * k_extent)
    return s_tir.Schedule(claim_iterations(func, grain, tile_var))


def _pad(sch: s_tir.Schedule, main, kinds: list[str], lanes: int) -> tuple[int, int, int | None, bool]:
    """(mt, nt, M, whether N is padded): the register tile (mt 1 without an I axis), a symbolic or ragged M
    and N padded to it with `pad_einsum`."""
    has_i = "I" in kinds

    def axis_extent(kind):
        return static_extent(sch, sch.get_loops(main)[kinds.index(kind)])

    mt, nt, pad_n = _tile_sizes(axis_extent("J"), lanes)
    m = axis_extent("I") if has_i else 1
    mt = mt if has_i else 1
    pad_m = m is None or m % mt != 0
    if pad_m or pad_n:
        sch.pad_einsum(main, [{"I": mt if pad_m else 1, "J": nt if pad_n else 1}.get(kd, 1) for kd in kinds])
    return mt, nt, m, pad_n


@dataclass(frozen=True)
class _Loops:
    """The matmul's loops once tiled: the parallel (batch, J / nt) tile, the I tiles and rows (None without
    an I axis), the columns of a tile, and the k loop (its iterations, then `unroll_k` steps unrolled)."""

    tile: object
    io: object
    ii: object
    ji: object
    k_loops: list
    unroll_k: int

    @property
    def k(self):
        return self.k_loops[0]


def _split_loops(sch: s_tir.Schedule, main, kinds: list[str], mt: int, nt: int) -> _Loops:
    """The nest of `schedule_matmul`'s docstring: (S, J / nt) fused and parallel, then I / mt, k, ii, ji."""
    loops = sch.get_loops(main)
    by_kind = {kind: [loop for loop, kd in zip(loops, kinds) if kd == kind] for kind in "TSIJK"}
    batch = by_kind["T"] + by_kind["S"]
    (j,), (k,) = by_kind["J"], by_kind["K"]
    jo, ji = sch.split(j, [None, nt])
    unroll_k = _unrolled_steps(static_extent(sch, k))
    k_loops = sch.split(k, [None, unroll_k]) if unroll_k > 1 else [k]  # iterations, and steps unrolled in each
    io = ii = None
    if by_kind["I"]:
        io, ii = sch.split(by_kind["I"][0], [None, mt])
        sch.reorder(*batch, jo, io, *k_loops, ii, ji)
    else:
        sch.reorder(*batch, jo, *k_loops, ji)
    tile = sch.fuse(*batch, jo) if batch else jo
    sch.parallel(tile)
    return _Loops(tile, io, ii, ji, k_loops, unroll_k)


def _pack_weights(sch: s_tir.Schedule, main, kinds: list[str], tile, many_rows: bool, lanes: int) -> None:
    """Pack the B panel once per task into [K, nt], whatever B's layout (dense weights are [N, K]):
    then the k loop streams one contiguous panel that stays in L1/L2 for every M tile. Not worth it
    for a few M tiles (`many_rows` false: measured at M = 16) of a [K, N] weight, unless B is transposed.
    Weights packed at load (compile/passes/packing.py) already are such panels: not called for them."""
    b_axes = [r.min for r in sch.get(main).reads[1].region]
    j_var, k_var = (sch.get(main).iter_vars[kinds.index(kd)].var for kd in "JK")
    transposed = b_axes.index(j_var) < b_axes.index(k_var)
    if not (many_rows or transposed):
        return
    b_pack = sch.cache_read(main, 1, "global")
    sch.compute_at(b_pack, tile, preserve_unit_loops=True)
    if transposed:
        pj, pk = b_axes.index(j_var), b_axes.index(k_var)
        perm = list(range(len(b_axes)))
        perm[pj], perm[pk] = pk, pj
        sch.transform_layout(main, ("read", 1), lambda *ax: [ax[p] for p in perm])
    vectorize_inner(sch, b_pack, lanes)


def _accumulate_in_registers(sch: s_tir.Schedule, main, loops: _Loops, lanes: int) -> None:
    """The register tile: mt x nt sums, the epilogue in their write-back, k steps and rows unrolled,
    columns in vectors.

    Accumulate in a small buffer the compiler keeps in registers: a stack alloca (TVM makes one
    under 1 KB, compile/lowering.py up to 4 KB), never a heap workspace, which LLVM may not
    promote (with symbolic shapes the kernel once ran 2.7x slower for it)."""
    acc = sch.cache_write(main, 0, "global")
    sch.reverse_compute_at(acc, loops.io if loops.io is not None else loops.tile, preserve_unit_loops=True)
    auto_inline_consumers(sch, acc)  # epilogue (and the un-padding copy) into the write-back
    vectorize_inner(sch, acc, lanes)
    if loops.unroll_k > 1:
        sch.unroll(loops.k_loops[1])
    if loops.ii is not None:
        sch.unroll(loops.ii)
    jv, jl = sch.split(loops.ji, [None, lanes])
    sch.unroll(jv)
    sch.vectorize(jl)
    init = sch.decompose_reduction(main, loops.k)
    vectorize_inner(sch, init, lanes)
