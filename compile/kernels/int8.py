"""The int8 kernel family for x86 CPUs: linears over int8 weights with int32 accumulation.

Weights are quantized symmetrically per output channel at compile time to [-127, 127] (for AVX2
with a bound on pairs, below) and stored int8, in panels of `panel` output columns with the reduction
axis in groups of `group`, `Wp[N / panel, K / group, panel, group]`, so that one register's worth
of columns x `group` k of a panel are contiguous bytes. Activations are quantized per row (token)
at run time, asymmetrically to unsigned bytes: the row's range [min(x, 0), max(x, 0)] onto
[0, 255], x ~ scale x (q - zero), with an integer zero point per row. A symmetric range would
leave half the codes unused where a row is one-signed, as GELU's outputs nearly are (>= -0.17),
the inputs of the FFN's second linear. The kernel subtracts zero x the weight column's sum
(computed at compile time) from each accumulator: exact in int32. The loop nest is the fp32
kernel's (`dense.schedule_matmul`): parallel over panels, a `rows` x `panel` int32 accumulator in
registers, the dequantisation and any fused epilogue (bias, GELU, residual) applied on write-back.
Four micro-kernels, chosen by the target's CPU (`Capabilities.int8_kernel`), all u8 x s8:

- `VNNI` (AVX-512 VNNI, `vpdpbusd`): 16 columns x 4 k of the panel times 4 broadcast activation
  bytes, 64 multiply-adds accumulated into 16 int32 lanes by one instruction (fp32 FMA: 16),
  summed in int32 without saturating.
- `AVX_VNNI` (AVX-VNNI, `vpdpbusd` on ymm: Intel Alder Lake and Sierra Forest, CPUs without
  AVX-512): VNNI's arithmetic in 8 int32 lanes, on the fp32 AVX2 kernel's 4 x 24 register tile.
- `AVX2` (`vpmaddubsw` + `vpmaddwd`), as oneDNN and MLAS do without VNNI: 8 columns x 4 k of the
  panel times 4 broadcast activation bytes; `vpmaddubsw` sums each pair of u8 x s8 products (k = 2i,
  2i + 1) into int16 (saturating), `vpmaddwd` by ones sums those pairs into 8 int32 lanes, `vpaddd`
  accumulates: 32 multiply-adds in 3 instructions (fp32 FMA: 8 in 1), half the time of the fp32
  kernel on a MiniLM linear, where `vpmaddwd` on int16-widened activations (16 in 2) ran at 0.95x
  fp32. Exact where every pair of one column's codes of one sign sums to at most 128
  (`PAIR_CODES`): 255 x 128 = 32640 < 32767. oneDNN and ONNX Runtime (`reduce_range`) get there by
  quantizing every weight to 7 bits; the compile knows the weights, so it scales each output channel
  by its largest same-sign pair sum instead (`int16_pairs`, `weight_scales` in
  compile/passes/quantize.py): 8-bit codes where a channel's large weights of one sign are not
  adjacent, 7-bit at worst (MiniLM's channels: 7.65 bits at the median). On MiniLM that took the
  plan's least cosine from 0.987 to 0.994 before any linear was kept out of int8, and none is now
  (docs/experiments/int8-pair-bounds.md). Every x86-64-v3 CPU has it.
- `AVX512BW` (`vpmaddubsw` + `vpmaddwd` on zmm): AVX2's arithmetic and weight scales in 16 int32
  lanes, on VNNI's 8-row tile and panels, for AVX-512 CPUs without VNNI (Skylake-SP) and for the
  `x86-64-v4` level, which every AVX-512 CPU loads and which names no VNNI.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, te, tirx
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers
from tvm.script import tirx as T

from . import amx, script
from .common import parallelize_leftovers, prefetch_next_panel, read_padded_rows_in_place
from .fallback import vectorize_inner
from .launch import claim_grain, claim_iterations
from .row_quantize import ACTIVATION, ACTIVATION_CODES
from .tiles import pad_rows_and_inline_panels, schedule_tiles

MATMUL = "int8_matmul"
PANEL_VIEW = "int8_panel_view"


@dataclass(frozen=True)
class Int8Kernel:
    """One int8 micro-kernel and the layouts it reads."""

    name: str
    group: int  # k values one int32 lane sums per instruction
    lanes: int  # int32 lanes of one register
    panel: int  # output columns per weight panel
    rows: int  # activation rows per register tile
    intrin: str
    description: str  # as the manifest records it
    features: tuple[str, ...]  # the LLVM features its instructions need (capabilities.py picks the best it finds)
    int16_pairs: bool = False  # pairs of products summed in saturating int16 (`PAIR_CODES`)
    wide_panel: int | None = None  # columns of a wider panel, where N is a multiple (`panel_width`)


# 8 x 48 tile where N allows: 24 zmm accumulators, as the fp32 AVX-512 kernel's; 8 x 32 (16) else and
# on CPUs with AMX, whose tiles read 32-column panels (`panel_width`)
VNNI = Int8Kernel("vnni", 4, 16, 32, 8, "bert_dot_16x4_u8i8_vnni",
                  "avx512 vnni vpdpbusd (uint8 activations x int8 weights), int32 accumulation",
                  ("avx512bw", "avx512vnni"), wide_panel=48)
# 4 x 16 tile: 8 ymm accumulators, 2 weight vectors, the ones vector, a broadcast and a product (LLVM
# keeps each weight vector in a register for the 4 rows: a 4 x 24 tile then needs 18 of the 16 ymm and
# spilled two accumulators at every k step; MiniLM's x86-64-v3 int8 calls at 16-512 tokens, paired
# against it, 0.96-1.00x the time, docs/experiments/avx2-int8-tile.md); weights scaled so that each pair's int16 sum
# is exact
AVX2 = Int8Kernel("avx2", 4, 8, 16, 4, "bert_dot_8x4_u8i8_avx2",
                  "avx2 vpmaddubsw + vpmaddwd (uint8 activations x int8 weights, same-sign pairs of codes "
                  "summing to at most 128), int32 accumulation", ("avx2",), int16_pairs=True)
# 4 x 24 (12 accumulators, 3 weight vectors, a broadcast: vpdpbusd needs no product), one vpdpbusd per
# 8 columns x 4 k (AVX2: three instructions), 8-bit weights
AVX_VNNI = Int8Kernel("avxvnni", 4, 8, 24, 4, "bert_dot_8x4_u8i8_avxvnni",
                      "avx-vnni vpdpbusd on ymm (uint8 activations x int8 weights), int32 accumulation",
                      ("avx2", "avxvnni"))
# VNNI's tile and panels (8 x 48: 24 zmm accumulators, the ones vector, a broadcast, a product), AVX2's
# arithmetic: three instructions per 16 columns x 4 k where VNNI takes one
AVX512BW = Int8Kernel("avx512bw", 4, 16, 32, 8, "bert_dot_16x4_u8i8_avx512bw",
                      "avx512bw vpmaddubsw + vpmaddwd (uint8 activations x int8 weights, same-sign pairs of codes "
                      "summing to at most 128), int32 accumulation", ("avx512bw",), int16_pairs=True,
                      wide_panel=48)
KERNELS = (VNNI, AVX512BW, AVX_VNNI, AVX2)  # the best first: a CPU runs the first whose features it has
WEIGHT_CODES = 127  # weights symmetric onto [-127, 127]
# vpmaddubsw: the largest sum of a pair's codes of one sign whose products with u8 activations stay
# within int16 (128)
PAIR_CODES = 32767 // ACTIVATION_CODES


def panel_width(kernel: Int8Kernel, n: int, amx_tiles: bool) -> int:
    """Columns of the weight panels of a linear of N outputs on `kernel`: its wide panel where N is a
    multiple and the target has no AMX tiles, which read 32-column panels (VNNI's 48: 3 weight vectors
    and 8 broadcasts per 24 `vpdpbusd`, where 32 columns took 2 and 8 per 16; MiniLM's int8 linears
    then take 0.90-0.99x the time at 128-512 tokens, docs/experiments/vnni-wide-panels.md), else its panel."""
    wide = kernel.wide_panel
    return wide if wide is not None and not on_amx(kernel, amx_tiles) and n % wide == 0 else kernel.panel


def on_amx(kernel: Int8Kernel, amx_tiles: bool) -> bool:
    """Whether `kernel`'s linears run on AMX's int8 tile (where K is a multiple of its step): it
    reads VNNI's activations and panels, on a target that has the tiles (`Capabilities.amx`)."""
    return amx_tiles and kernel is VNNI


# ----------------------------------------------------------------------------- micro-kernels


def _quads_desc(lanes: int):
    """What both micro-kernels compute: `lanes` int32 sums of 4 u8 x s8 products each."""

    @script.prim_func(s_tir=True)
    def desc(A: T.Buffer((4,), "uint8", offset_factor=1), B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")

    return desc


def _quads_impl(lanes: int, accumulate):
    """The micro-kernel whose `lanes` int32 sums become `accumulate(sums, broadcast activation bytes,
    weight bytes)`, each operand a vector of the whole register."""
    accumulators, products = f"int32x{lanes}", f"int8x{4 * lanes}"

    @script.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), "uint8", offset_factor=1), B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            quad = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] = accumulate(
                C.vload([0], dtype=accumulators), T.reinterpret(T.broadcast(quad, lanes), dtype=products),
                B.vload([0, 0], dtype=products))

    return impl


def _quads_vpdpbusd(lanes: int, intrinsic: str):
    """`lanes` columns x 4 k in one vpdpbusd (AVX-512 VNNI on zmm; on ymm, LLVM selects the VEX,
    AVX-VNNI, encoding on a CPU without AVX-512 VL)."""
    return _quads_impl(lanes, lambda sums, activations, weights: tirx.call_llvm_pure_intrin(
        f"int32x{lanes}", intrinsic, sums, activations, weights))


def _quads_pmaddubsw(lanes: int, pairs_intrinsic: str, quads_intrinsic: str):
    """`lanes` columns x 4 k in `vpmaddubsw` (pairs of u8 x s8 products, summed in saturating int16)
    and `vpmaddwd` by ones (the pairs' sums, in int32), accumulated by `vpaddd`."""
    def accumulate(sums, activations, weights):
        pairs = tirx.call_llvm_pure_intrin(f"int16x{2 * lanes}", pairs_intrinsic, activations, weights)
        ones = tirx.Broadcast(tirx.const(1, "int16"), 2 * lanes)
        return sums + tirx.call_llvm_pure_intrin(f"int32x{lanes}", quads_intrinsic, pairs, ones)

    return _quads_impl(lanes, accumulate)


for _kernel, _impl in ((VNNI, _quads_vpdpbusd(16, "llvm.x86.avx512.vpdpbusd.512")),
                       (AVX512BW, _quads_pmaddubsw(16, "llvm.x86.avx512.pmaddubs.w.512",
                                                   "llvm.x86.avx512.pmaddw.d.512")),
                       (AVX_VNNI, _quads_vpdpbusd(8, "llvm.x86.avx512.vpdpbusd.256")),
                       (AVX2, _quads_pmaddubsw(8, "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"))):
    if TensorIntrin.get(_kernel.intrin, allow_missing=True) is None:
        TensorIntrin.register(_kernel.intrin, _quads_desc(_kernel.lanes), _impl)


# ----------------------------------------------------------------------------- TE kernels


def quantizable(n: int, k: int, kernel: Int8Kernel) -> bool:
    """Whether a linear of N outputs and K inputs fits the kernel's panels without padding."""
    return n % kernel.panel == 0 and k % kernel.group == 0


def int8_matmul_te(xq: te.Tensor, scale: te.Tensor, zero: te.Tensor, panels: te.Tensor, weight_scale: te.Tensor,
                   column_sum: te.Tensor) -> te.Tensor:
    """y[M, N] = dequantised (xq @ W^T), W given as panels Wp[j // panel, k // group, j % panel, k % group];
    the activations' zero point is taken out exactly: acc - zero[m] x column_sum[j] (int32, the
    column's sum of quantized weights)."""
    count, groups, width, group = (int(d) for d in panels.shape)
    # W[j, k] as an (inlined) view of the panels keeps the matmul a plain einsum `pad_einsum` accepts
    weight = te.compute((_i64(count * width), _i64(groups * group)),
                        lambda j, kk: panels[j // width, kk // group, j % width, kk % group], name=PANEL_VIEW)
    k = te.reduce_axis((0, _i64(groups * group)), name="k")
    acc = te.compute((xq.shape[0], weight.shape[0]),
                     lambda m, j: te.sum(xq[m, k].astype("int32") * weight[j, k].astype("int32"), axis=k), name=MATMUL)

    def dequantize(m, j):
        return (acc[m, j] - zero[m] * column_sum[j]).astype("float32") * scale[m] * weight_scale[j]

    return te.compute(acc.shape, dequantize, name="dequantize")


def te_kernels() -> dict[str, tuple]:
    """Our int8 TE kernels by primfunc name: the function that writes one and how many tensors it
    takes (compile/passes/specialize.py rewrites them per bucket)."""
    return {matmul_name(kernel): (int8_matmul_te, 6) for kernel in KERNELS}


def matmul_name(kernel: Int8Kernel) -> str:
    return f"{MATMUL}_{kernel.name}"


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


# ----------------------------------------------------------------------------- schedules


def _int8_matmul_block(sch: s_tir.Schedule, kernel: Int8Kernel):
    """The block accumulating quantized activations x int8 weights in int32 in `kernel`'s layouts, and
    its panels' width; or None."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        dtypes = [r.source.dtype for r in stmt.reads]
        if not (len(stmt.reads) == 2 and len(stmt.writes) == 1 and stmt.writes[0].source.dtype == "int32"
                and dtypes[1] == "int8" and len(stmt.iter_vars) == 3):
            continue
        for producer in sch.get_producers(block):
            view = sch.get(producer)
            if view.name_hint.startswith(PANEL_VIEW) and len(view.reads[0].source.shape) == 4:
                _, _, panel, group = (int(d) for d in view.reads[0].source.shape)
                if (dtypes[0], group) == (ACTIVATION, kernel.group) and panel in (kernel.panel, kernel.wide_panel):
                    return block, panel
    return None


def schedule_int8_matmul(func: tirx.PrimFunc, kernel: Int8Kernel | None,
                         amx_tiles: bool = False) -> s_tir.Schedule | None:
    """Schedule the int8 matmul (and its fused epilogue) of `func` on `kernel`, the target's
    (`Capabilities.int8_kernel`), or None when it has none in that kernel's layouts.
    Where `amx_tiles` (the target has them, `Capabilities.amx`), VNNI's layouts are read by AMX's 32 x 32
    tile in whole-K calls (`tiles.schedule_tiles`) when K is a multiple of its step; else:

        parallel (N / panel, claimed by the threads as they come free: launch.claim_iterations):
          for M / rows:
            acc[rows, panel] = 0
            for K / group:  prefetch step k of the next panel (first M tile: `common.prefetch_next_panel`)
                            unrolled rows x panel / lanes:  acc[i, lanes cols] += micro-kernel(x group, panel)
            y[rows, panel] = epilogue((acc - zero x column sum) * row scale * column scale)
    A symbolic or ragged M is padded to a multiple of rows (`pad_einsum`), the rows past M read clamped
    to the last rather than from a zero-padded copy (`common.read_padded_rows_in_place`), as the fp32
    kernel does.
    """
    if kernel is None:
        return None
    sch = s_tir.Schedule(func)
    found = _int8_matmul_block(sch, kernel)
    if found is None:
        return None
    main, panel = found
    m, j, k = sch.get_loops(main)
    if on_amx(kernel, amx_tiles) and amx.INT8.fits(sch.get(k).extent):
        return schedule_tiles(sch, main, amx.INT8, PANEL_VIEW)
    m, j, k = pad_rows_and_inline_panels(sch, main, kernel.rows, PANEL_VIEW)
    k_size = sch.get(k).extent
    activations, panels = (region.source for region in sch.get(main).reads[:2])
    jo, jv, jl = sch.split(j, [None, panel // kernel.lanes, kernel.lanes])
    mo, mi = sch.split(m, [None, kernel.rows])
    ko, ki = sch.split(k, [None, kernel.group])
    sch.reorder(jo, mo, ko, mi, jv, jl, ki)
    sch.parallel(jo)
    acc = sch.cache_write(main, 0, "global")  # a small constant-size buffer: registers (see dense)
    sch.reverse_compute_at(acc, mo, preserve_unit_loops=True)
    auto_inline_consumers(sch, acc)
    vectorize_inner(sch, acc, kernel.lanes)
    init = sch.decompose_reduction(main, ko)
    vectorize_inner(sch, init, kernel.lanes)
    sch.unroll(mi)
    sch.unroll(jv)
    sch.tensorize(jl, kernel.intrin)
    parallelize_leftovers(sch)
    func = read_padded_rows_in_place(sch.mod["main"], activations)  # each micro-kernel call reads one row
    panel_var = sch.get(jo).loop_var
    func = prefetch_next_panel(func, sch.get(ko).loop_var, panel_var, panels, sch.get(mo).loop_var)
    grain = claim_grain(sch.get(mo).extent * kernel.rows * panel * k_size)
    return s_tir.Schedule(claim_iterations(func, grain, panel_var))
