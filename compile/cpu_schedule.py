"""A dlight-style CPU schedule for the fused PrimFuncs of a Relax module.

TVM 0.27's default CPU lowering leaves every fused PrimFunc as the serial, scalar loop nest that
LegalizeOps wrote, and `tvm.s_tir.dlight.cpu` has no matmul rule, so a whole BERT runs ~100x
slower than PyTorch. `cpu_schedule_pass` schedules each PrimFunc with the first rule that applies:

0. the int8 kernels of `--quantize int8` (compile/int8.py);
1. `schedule_matmul`: matmul / dense with a transposed weight / batch matmul, with injective
   epilogues (bias, GELU, residual add, scaling) and static or symbolic M, as a register-blocked
   micro-kernel (see its docstring);
2. `softmax.schedule_softmax` for attention's softmax rows (vectorised reductions), then
   dlight's CPU `Reduction` rule for the other softmax / layer-norm shaped kernels;
3. `schedule_fallback`: inline injective blocks, then per remaining block fuse the outer loops
   into one parallel loop and vectorise the innermost loop where that is legal.

A PrimFunc no rule recognises (or on which every rule raises) is left untouched, so the pass is
always safe to add.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu import Reduction
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features

from . import int8
from .softmax import schedule_softmax

SCHEDULED_ATTR = "tirx.is_scheduled"
log = logging.getLogger(__name__)


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


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    """A loop's extent as an int, or None when it is symbolic."""
    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _root_blocks(sch: s_tir.Schedule) -> list:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _try(fn, *args) -> bool:
    """Apply one optional schedule primitive; a refusal leaves the schedule as it was.

    TVM 0.27 raises `ScheduleError` / `InternalError`, both RuntimeErrors, and has no TVMError.
    """
    try:
        fn(*args)
        return True
    except (RuntimeError, ValueError):
        return False


# ----------------------------------------------------------------------------- matmul


def _tile_sizes(n: int | None, lanes: int) -> tuple[int, int, bool]:
    """(mt, nt, pad_n): the register tile and whether N must be padded to a multiple of nt.

    The mt x nt accumulator must fit the register file with room for the B vectors and one A
    broadcast: AVX2 has 16 ymm -> 4 x 24 (12 accumulators, measured best of 4x16, 4x24, 6x16,
    8x16 here); AVX-512 has 32 zmm -> 8 x 32 (16 accumulators, no spills in the generated asm).
    nt is the widest candidate dividing a static N, so the N tail needs no padding; otherwise N
    is padded to 2 vectors (1 vector when N is that small).
    """
    mt = 8 if lanes >= 16 else 4
    candidates = [2 * lanes, lanes] if lanes >= 16 else [3 * lanes, 2 * lanes, lanes]
    for nt in candidates:
        if n is not None and n % nt == 0:
            return mt, nt, False
    return mt, (lanes if n is not None and n < 2 * lanes else 2 * lanes), True


def packed_panel_width(n: int, lanes: int) -> int | None:
    """The nt of the panels `schedule_matmul` would cut a weight of N columns into, or None when N
    needs padding (then the weight is better left unpacked)."""
    _, nt, pad_n = _tile_sizes(n, lanes)
    return None if pad_n else nt


PANEL_VIEW = "panel_view"  # the block compile/packing.py reads packed weights through


def _panel_view(sch: s_tir.Schedule, block, nt: int):
    """The producer of `block`'s B operand that views weights packed in panels of width `nt`
    (W[j, k] = Wp[j // nt, k, j % nt], see compile/packing.py), or None."""
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
    "I" (A and C), "J" (B and C), "K" (reduced, in A and B), "T" (extent 1, anywhere). Unlike dlight's `detect_iter_traits`
    an absent I axis is allowed (M = 1 is a trivial axis), so a bucket of 1 x 1 still matches.
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
        parallel (S, J / nt):                  # enough tasks for all cores even at M = 16
          B_pack[K, nt] = B[S, :, J tile]      # contiguous, and stays in L1/L2 for all of M
          for I / mt:
            acc[mt, nt] = 0
            for k:  unrolled ii < mt:  vectorised ji < nt:  acc[ii, ji] += A[ii, k] * B_pack[k, ji]
            C[I tile, J tile] = epilogue(acc)  # bias, GELU, residual add, ... fused, vectorised
    Each B vector load feeds mt FMAs and each A broadcast nt / lanes FMAs. Symbolic or ragged M
    (and N) are padded with `pad_einsum`, so the hot loop has no bounds checks: a copy of A padded
    to a multiple of mt costs M * K, nothing next to the M * N * K multiply-adds. M = 1 (an axis
    of extent 1 is "trivial" to the analysis) runs the same nest with mt = 1.
    """
    sch = s_tir.Schedule(func)
    reductions = [b for b in _root_blocks(sch) if _is_reduction(sch, b)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    kinds = matmul_axes(sch.get(main))
    if kinds is None:
        return None
    I, J, K = "I", "J", "K"
    has_i = I in kinds

    def extent(kind):
        return _extent(sch, sch.get_loops(main)[kinds.index(kind)])

    mt, nt, pad_n = _tile_sizes(extent(J), lanes)
    m = extent(I) if has_i else 1
    mt = mt if has_i else 1
    pad_m = m is None or m % mt != 0
    if pad_m or pad_n:
        sch.pad_einsum(main, [{I: mt if pad_m else 1, J: nt if pad_n else 1}.get(kd, 1) for kd in kinds])
    panel_view = None if pad_n else _panel_view(sch, main, nt)
    if panel_view is not None:  # read the packed panels directly: B[j, k] becomes Wp[j // nt, k, j % nt]
        sch.compute_inline(panel_view)

    loops = sch.get_loops(main)
    by_kind = {kind: [loop for loop, kd in zip(loops, kinds) if kd == kind] for kind in "TSIJK"}
    batch = by_kind["T"] + by_kind["S"]
    (j,), (k,) = by_kind[J], by_kind[K]
    jo, ji = sch.split(j, [None, nt])
    if has_i:
        io, ii = sch.split(by_kind[I][0], [None, mt])
        sch.reorder(*batch, jo, io, k, ii, ji)
    else:
        sch.reorder(*batch, jo, k, ji)
    tile = sch.fuse(*batch, jo) if batch else jo
    sch.parallel(tile)

    # Pack the B panel once per task into [K, nt], whatever B's layout (dense weights are [N, K]):
    # then the k loop streams one contiguous panel that stays in L1/L2 for every M tile. Not
    # worth it for a few M tiles of a [K, N] weight (measured at M = 16), unless B is transposed.
    # Weights packed at load (compile/packing.py) already are such panels.
    b_axes = [r.min for r in sch.get(main).reads[1].region]
    j_var, k_var = (sch.get(main).iter_vars[kinds.index(kd)].var for kd in (J, K))
    transposed = panel_view is None and b_axes.index(j_var) < b_axes.index(k_var)
    if panel_view is None and (m is None or m >= 8 * mt or transposed):
        b_pack = sch.cache_read(main, 1, "global")
        sch.compute_at(b_pack, tile, preserve_unit_loops=True)
        if transposed:
            pj, pk = b_axes.index(j_var), b_axes.index(k_var)
            perm = list(range(len(b_axes)))
            perm[pj], perm[pk] = pk, pj
            sch.transform_layout(main, ("read", 1), lambda *ax: [ax[p] for p in perm])
        _vectorize_inner(sch, b_pack, lanes)

    # Accumulate in a small buffer the compiler keeps in registers. Scope "global", not "local":
    # LowerTVMBuiltin turns a small constant-size "global" allocation into a stack alloca, while
    # with symbolic shapes a "local" one became a heap workspace and the kernel ran 2.7x slower.
    acc = sch.cache_write(main, 0, "global")
    sch.reverse_compute_at(acc, io if has_i else tile, preserve_unit_loops=True)
    auto_inline_consumers(sch, acc)  # epilogue (and the un-padding copy) into the write-back
    _vectorize_inner(sch, acc, lanes)

    if has_i:
        sch.unroll(ii)
    jv, jl = sch.split(ji, [None, lanes])
    sch.unroll(jv)
    sch.vectorize(jl)
    init = sch.decompose_reduction(main, k)
    _vectorize_inner(sch, init, lanes)

    # Whatever could not be fused (the padded copy of A, an epilogue the inliner refused) still
    # runs in parallel and vectorised.
    for block in _root_blocks(sch):
        loops = sch.get_loops(block)
        if loops and sch.get(loops[0]).kind != tirx.ForKind.PARALLEL:
            _parallel_vectorize(sch, block, lanes)
    return sch


# ----------------------------------------------------------------------------- fallback


def _vectorize_inner(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorise the innermost loop of `block` by `lanes` when its extent allows it."""
    loop = sch.get_loops(block)[-1]
    extent = _extent(sch, loop)
    if extent is None or extent < 2:
        return
    if extent <= lanes:
        _try(sch.vectorize, loop)
    elif extent % lanes == 0:
        _, inner = sch.split(loop, [None, lanes])
        _try(sch.vectorize, inner)


def _parallel_vectorize(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Vectorise a spatial innermost loop, and run the loops above it as one parallel loop.

    A reduction block keeps its reduction loops serial: only its leading spatial loops are fused
    and parallelised, so each task owns whole output elements and needs no atomic update. The
    runtime hands each thread one contiguous chunk of the fused loop, so fine iterations are fine.
    """
    iter_types = [iv.iter_type for iv in sch.get(block).iter_vars]
    if not iter_types or len(sch.get_loops(block)) != len(iter_types):
        return  # not the trivial one-loop-per-block-var nest LegalizeOps writes; leave it
    if all(t == tirx.IterVar.DataPar for t in iter_types):
        _vectorize_inner(sch, block, lanes)
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
        _try(sch.parallel, sch.fuse(*outer) if len(outer) > 1 else outer[0])


def schedule_fallback(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    """Inline injective blocks, then parallelise + vectorise every remaining block."""
    sch = s_tir.Schedule(func)
    blocks = _root_blocks(sch)
    if not blocks:
        return None
    for block in blocks[:-1]:  # the last block writes the output and cannot be inlined
        if not _is_reduction(sch, block):
            _try(sch.compute_inline, block)
    for block in _root_blocks(sch):
        _parallel_vectorize(sch, block, lanes)
    return sch


# ----------------------------------------------------------------------------- exp / erf

# LLVM has no vector erf and lowers exp to libm `expf`, so TVM emits one scalar libm call per
# element and those loops cannot be vectorised: the softmax's exp cost 17% of the whole model and
# the GELU's erf more than the FFN matmul it is fused into. The float32 rational / polynomial
# forms below (the ones `topi.fast_exp` / `topi.fast_erf` use, from Cephes and Eigen; relative
# error ~1e-7) vectorise like any other arithmetic.
_EXP, _ERF = tvm.ir.Op.get("tirx.exp"), tvm.ir.Op.get("tirx.erf")
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
          5.0000001201e-1)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _f32(value: float):
    return tirx.const(value, "float32")


def _horner(x, coefficients):
    result = _f32(coefficients[0])
    for c in coefficients[1:]:
        result = result * x + _f32(c)
    return result


def _fast_exp(v):
    x = tirx.max(tirx.min(v, _f32(88.3762626647950)), _f32(-88.3762626647949))
    n = tirx.floor(x * _f32(1.44269504088896341) + _f32(0.5))
    f = x - n * _f32(0.6931471805599453)
    y = _horner(f, _EXP_P) * f * f + f + _f32(1.0)
    two_n = tirx.reinterpret("float32", tirx.Cast("int32", n + _f32(127.0)) << 23)
    return tirx.max(two_n * y, v)


def _fast_erf(v):
    x = tirx.max(tirx.min(v, _f32(4.0)), _f32(-4.0))
    return x * _horner(x * x, _ERF_P) / _horner(x * x, _ERF_Q)


def _rewrite_call(call):
    if str(call.ty) == "float32" and len(call.args) == 1:
        if call.op.same_as(_EXP):
            return _fast_exp(call.args[0])
        if call.op.same_as(_ERF):
            return _fast_erf(call.args[0])
    return call


def fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with float32 exp and erf replaced by their vectorisable approximations."""
    return tvm_ffi.structural_map(func, [(tvm.ir.expr.Call, _rewrite_call)])


# ----------------------------------------------------------------------------- the pass


def schedule_func(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
    """The scheduled `func`, or None when no rule recognises it (or every rule fails on it)."""
    lanes = vector_lanes(target)
    func = fast_math(func)
    rules = (
        int8.schedule_int8_matmul,
        int8.schedule_row_quantize,
        lambda f: schedule_matmul(f, lanes),
        lambda f: schedule_softmax(f, lanes),
        lambda f: Reduction().apply(f, target, False),
        lambda f: schedule_fallback(f, lanes),
    )
    for rule in rules:
        try:
            sch = rule(func)
        except Exception as error:  # noqa: BLE001 - any failing rule just hands over to the next
            log.debug("%s: %s", getattr(rule, "__name__", rule), error)
            sch = None
        if sch is not None:
            return sch.mod["main"].with_attr(SCHEDULED_ATTR, True)
    return None


def cpu_schedule_pass(target: Target) -> tvm.ir.transform.Pass:
    """Module pass: schedule every PrimFunc a rule recognises, leave the others untouched.

    Insert it after LegalizeOps + AnnotateTIROpPattern + FoldConstant + FuseOps + FuseTIR and
    before the dataflow-lowering passes, as `cpu_pipeline` does.
    """

    @tvm.transform.module_pass(opt_level=0, name="CPUSchedule")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and not func.attrs.get(SCHEDULED_ATTR, False):
                scheduled = schedule_func(func, target)
                if scheduled is not None:
                    updates[gvar] = scheduled
        if not updates:
            return mod
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod.update_func(gvar, func)
        return mod

    return _pass


def cpu_pipeline(target: Target) -> tvm.ir.transform.Pass:
    """TVM's default CPU Relax pipeline (relax/backend/cpu_generic) with `cpu_schedule_pass` in it.

    A drop-in for `relax.get_default_pipeline(target)` on an llvm target:
    `tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target))`.
    """
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    passes = (
        cpu.library_dispatch_passes(target)
        + cpu.legalize_passes(target)
        + [cpu_schedule_pass(target)]
        + cpu.dataflow_lower_passes(target)
        + cpu.finalize_passes(target)
    )

    @tvm.transform.module_pass(opt_level=0, name="CPUPipelineWithSchedule")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
