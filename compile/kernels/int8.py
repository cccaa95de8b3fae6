"""The int8 kernel family for x86 CPUs: linears over int8 weights with int32 accumulation.

Weights are quantized symmetrically per output channel at compile time and stored int8, in
panels of `PANEL` columns with the reduction axis in pairs, `Wp[N / PANEL, K / 2, PANEL, 2]`, so
that 8 output columns x 2 k of one panel are 16 contiguous bytes. Activations are quantized per
row (token) at run time, symmetrically to [-127, 127], held as int16.

The micro-kernel is AVX2's `vpmaddwd`: 8 columns x 2 k of the panel, sign-extended to int16
(`vpmovsxbw`), times one broadcast pair of activations, summed pairwise into 8 int32 lanes: 16
multiply-adds per instruction where fp32 FMA does 8, exact (127 x 127 x 2 cannot saturate, unlike
`vpmaddubsw`'s u8 x s8 pairs, which measured slower here as well as less accurate with 7-bit
weights). Each vpmaddwd needs a separate vpaddd, so the gain over fp32 FMA comes from the ports
they share less and from weights 4x smaller (docs/PERFORMANCE.md, int8). The loop nest is the fp32 kernel's
(`dense.schedule_matmul`): parallel over panels, a `ROWS` x `PANEL` int32 accumulator in
registers, the dequantisation and any fused epilogue applied on write-back.

AVX2 is on every x86-64-v3 CPU, AVX-512 ones included, so one kernel serves both; a VNNI
(`vpdpwssd`) or 512-bit variant is a later lever.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, te, tirx
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers
from tvm.script import tirx as T

LANES = 8  # int32 lanes of one AVX2 register
PAIR = 2  # reduction values one vpmaddwd lane multiplies and adds
PANEL = 24  # output columns per panel: 4 x 3 registers of accumulators leave 4 for operands
ROWS = 4  # activation rows per register tile (4 x 24 measured best of 8 tiles from 3 x 32 to 8 x 8)
QMAX = 127.0
INTRIN = "bert_dot_8x2_i16i8_avx2"
ROW_QUANTIZE = "quantize_rows"
MATMUL = "int8_matmul"
PANEL_VIEW = "int8_panel_view"


@T.prim_func(s_tir=True)
def _dot_desc(A: T.Buffer((2,), "int16", offset_factor=1), B: T.Buffer((8, 2), "int8", offset_factor=1),
              C: T.Buffer((8,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:8], A[0:2], B[0:8, 0:2])
        T.writes(C[0:8])
        for i in T.serial(0, 8):
            for k in T.serial(0, 2):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")


@T.prim_func(s_tir=True)
def _dot_avx2(A: T.Buffer((2,), "int16", offset_factor=1), B: T.Buffer((8, 2), "int8", offset_factor=1),
              C: T.Buffer((8,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:8], A[0:2], B[0:8, 0:2])
        T.writes(C[0:8])
        pair = T.reinterpret(A.vload([0], "int16x2"), dtype="int32")
        C[T.ramp(T.int32(0), 1, 8)] += T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
            T.reinterpret(T.broadcast(pair, 8), dtype="int16x16"),
            T.cast(B.vload([0, 0], dtype="int8x16"), "int16x16"),
            dtype="int32x8")


if TensorIntrin.get(INTRIN, allow_missing=True) is None:
    TensorIntrin.register(INTRIN, _dot_desc, _dot_avx2)


def quantizable(n: int, k: int) -> bool:
    """Whether a linear of N outputs and K inputs fits the panels without padding."""
    return n % PANEL == 0 and k % PAIR == 0


def quantize_rows_te(x: te.Tensor) -> list[te.Tensor]:
    """(xq int16 [M, K], scale float32 [M]): each row scaled so that its largest |value| is 127."""
    k = te.reduce_axis((0, x.shape[1]), name="k")
    absmax = te.compute((x.shape[0],), lambda m: te.max(te.abs(x[m, k]), axis=k), name="row_absmax")
    scale = te.compute((x.shape[0],), lambda m: te.max(absmax[m], tirx.const(1e-30, "float32")) / QMAX,
                       name="row_scale")
    quantized = te.compute(x.shape, lambda m, kk: te.round(x[m, kk] / scale[m]).astype("int16"), name="row_quantize")
    return [quantized, scale]


def int8_matmul_te(xq: te.Tensor, scale: te.Tensor, panels: te.Tensor, weight_scale: te.Tensor) -> te.Tensor:
    """y[M, N] = dequantised (xq @ W^T), W given as int8 panels Wp[j // PANEL, k // 2, j % PANEL, k % 2]."""
    count, pairs, width, _ = (int(d) for d in panels.shape)
    # W[j, k] as an (inlined) view of the panels keeps the matmul a plain einsum `pad_einsum` accepts
    weight = te.compute((_i64(count * width), _i64(pairs * PAIR)),
                        lambda j, kk: panels[j // width, kk // PAIR, j % width, kk % PAIR], name=PANEL_VIEW)
    k = te.reduce_axis((0, _i64(pairs * PAIR)), name="k")
    acc = te.compute((xq.shape[0], weight.shape[0]),
                     lambda m, j: te.sum(xq[m, k].astype("int32") * weight[j, k].astype("int32"), axis=k), name=MATMUL)
    return te.compute(acc.shape, lambda m, j: acc[m, j].astype("float32") * scale[m] * weight_scale[j],
                      name="dequantize")


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


def _int8_matmul_block(sch: s_tir.Schedule):
    """The block accumulating int16 x int8 products in int32, with its (M, N, K) loops, or None."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if (len(stmt.reads) == 2 and len(stmt.writes) == 1 and stmt.writes[0].source.dtype == "int32"
                and [r.source.dtype for r in stmt.reads] == ["int16", "int8"] and len(stmt.iter_vars) == 3):
            return block
    return None


def schedule_int8_matmul(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """Schedule the int8 matmul (and its fused epilogue) of `func`, or None when it has none.

        parallel (N / PANEL):
          for M / ROWS:
            acc[ROWS, PANEL] = 0
            for K / 2:  unrolled ROWS x PANEL / 8:  acc[i, 8 cols] += vpmaddwd(x pair, panel 8 x 2)
            y[ROWS, PANEL] = epilogue(acc * row scale * column scale)
    A symbolic or ragged M is padded to a multiple of ROWS (`pad_einsum`), as the fp32 kernel does.
    """
    sch = s_tir.Schedule(func)
    main = _int8_matmul_block(sch)
    if main is None:
        return None
    m, j, k = sch.get_loops(main)
    rows = sch.get(m).extent
    if not (isinstance(rows, tirx.IntImm) and int(rows) % ROWS == 0):
        sch.pad_einsum(main, [ROWS, 1, 1])
        m, j, k = sch.get_loops(main)
    for producer in sch.get_producers(main):
        if sch.get(producer).name_hint.startswith(PANEL_VIEW):
            sch.compute_inline(producer)
    jo, jv, jl = sch.split(j, [None, PANEL // LANES, LANES])
    mo, mi = sch.split(m, [None, ROWS])
    ko, ki = sch.split(k, [None, PAIR])
    sch.reorder(jo, mo, ko, mi, jv, jl, ki)
    sch.parallel(jo)
    acc = sch.cache_write(main, 0, "global")  # a small constant-size buffer: registers (see dense)
    sch.reverse_compute_at(acc, mo, preserve_unit_loops=True)
    auto_inline_consumers(sch, acc)
    _vectorize_innermost(sch, acc)
    init = sch.decompose_reduction(main, ko)
    _vectorize_innermost(sch, init)
    sch.unroll(mi)
    sch.unroll(jv)
    sch.tensorize(jl, INTRIN)
    for block in sch.get_child_blocks(sch.get_sblock("root")):  # the padded copy of xq, the un-padding
        loops = sch.get_loops(block)
        if loops and sch.get(loops[0]).kind != tirx.ForKind.PARALLEL:
            sch.parallel(loops[0])
    return sch


def _vectorize_innermost(sch: s_tir.Schedule, block) -> None:
    _, inner = sch.split(sch.get_loops(block)[-1], [None, LANES])
    sch.vectorize(inner)


def schedule_row_quantize(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """Rows in parallel: the row's largest |value| (a serial reduction), then the quantized row,
    vectorised. None when `func` does not end in the row quantisation."""
    sch = s_tir.Schedule(func)
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    names = [sch.get(block).name_hint for block in blocks]
    if not any(name.startswith("row_quantize") for name in names):
        return None
    for block, name in zip(blocks, names):
        if name.startswith(("row_absmax", "row_quantize", "row_scale")):
            continue
        try:  # the producers FuseOps put in front (layer norm's last step): recompute per row
            sch.compute_inline(block)
        except (RuntimeError, ValueError):
            pass
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        sch.parallel(loops[0])
        if len(loops) > 1 and not any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars):
            extent = sch.get(loops[-1]).extent
            if isinstance(extent, tirx.IntImm) and int(extent) % LANES == 0:
                _vectorize_innermost(sch, block)
    return sch


def supports(target: tvm.target.Target) -> bool:
    """Whether the host CPU of `target` runs the AVX2 kernel."""
    from tvm.target.codegen import llvm_cpu_has_features

    return target.kind.name == "llvm" and llvm_cpu_has_features("avx2", target)
