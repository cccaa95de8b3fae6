"""The int8 row quantizer for CPUs: each token's activations onto unsigned bytes, per row, at run time.

Every int8 linear (kernels/int8.py) reads its input as bytes with a scale and a zero point per
row: the row's range [min(x, 0), max(x, 0)] onto [0, 255], x ~ scale x (q - zero). Where the
compile smoothed the linear (passes/smooth.py), the row first takes the per-channel multiply by
1 / s that moves activation outliers into the weights; folded in here, it costs no pass of its own.

`quantize_rows_te` says what is computed (and is what the graph carries through fusion and each
bucket's specialisation). The generic rules would read a row once per reduction, each one
dependent chain of vector min / max (and cannot schedule the smoothed form as one row loop):
`schedule_row_quantize` puts in its place, for the same parameters, the kernel written below
(`write_row_quantize`; in `loadtest.kernel_profile` of a 512-token int8 MiniLM call on an AVX-512
Xeon, under half the time of the generic quantizer and the separate multiply it replaces): one
parallel loop over rows, and in each row

    low[u], high[u] = min / max over the row's vectors u, u + U, u + 2U, ... (from 0)   U chains
    scale = max(max(high) - min(low), 1e-30) / 255; zero = round(-min(low) / scale)
    q = clamp(round(x / scale) + zero, 0, 255)

two passes over a row that stays in L1, the same values bit for bit.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from . import script
from .common import prescheduled, root_blocks, without_param

ACTIVATION = "uint8"  # the int8 kernels multiply unsigned activation bytes by signed weight bytes
ACTIVATION_CODES = 255  # a row's range onto [0, 255]
ROW_QUANTIZE = "quantize_rows"
SMOOTHED_ROW_QUANTIZE = "quantize_smoothed_rows"  # a name `ROW_QUANTIZE` is not a prefix of
CHAINS = 4  # independent min / max chains per row (vector min / max: latency 4, 2 per cycle)
_BLOCKS = frozenset({"row_min", "row_max", "row_scale", "row_zero", "row_quantize"})
_SMOOTHED = "row_smoothed"


def quantize_rows_te(x: te.Tensor, multiplier: te.Tensor | None = None) -> list[te.Tensor]:
    """(xq [M, K] uint8, scale float32 [M], zero int32 [M]) of x (times `multiplier` [K], per
    channel, where given): each row's range [min(x, 0), max(x, 0)] onto [0, 255],
    x ~ scale x (xq - zero), xq = round(x x (1 / scale)) + zero. Zero is in the range, so zero is a code."""
    if multiplier is not None:
        x = te.compute(x.shape, lambda m, kk: x[m, kk] * multiplier[kk], name=_SMOOTHED)
    top = tirx.const(float(ACTIVATION_CODES), "float32")
    k = te.reduce_axis((0, x.shape[1]), name="k")
    low = te.compute((x.shape[0],), lambda m: te.min(x[m, k], axis=k), name="row_min")
    k = te.reduce_axis((0, x.shape[1]), name="k")
    high = te.compute((x.shape[0],), lambda m: te.max(x[m, k], axis=k), name="row_max")
    nothing = tirx.const(0.0, "float32")
    scale = te.compute((x.shape[0],), lambda m: te.max(te.max(high[m], nothing) - te.min(low[m], nothing),
                                                       tirx.const(1e-30, "float32")) / top, name="row_scale")
    one = tirx.const(1.0, "float32")
    zero = te.compute((x.shape[0],), lambda m: te.round(-te.min(low[m], nothing) * (one / scale[m])).astype("int32"),
                      name="row_zero")

    def code(m, kk):  # x times 1 / scale: one multiply per element (the reciprocal is hoisted out of the row)
        inverse = one / scale[m]
        return te.min(te.max(te.round(x[m, kk] * inverse) + zero[m].astype("float32"), nothing), top).astype(ACTIVATION)

    quantized = te.compute(x.shape, code, name="row_quantize")
    return [quantized, scale, zero]


def te_kernels() -> dict[str, tuple]:
    """The quantizers by primfunc name: the function that writes one and how many tensors it takes
    (compile/passes/specialize.py rewrites them per bucket)."""
    return {ROW_QUANTIZE: (quantize_rows_te, 1), SMOOTHED_ROW_QUANTIZE: (quantize_rows_te, 2)}


def write_row_quantize(rows, width: int, lanes: int, smoothed: bool) -> tirx.PrimFunc:
    """The quantizer of [rows, width] float32 rows (`rows` an int or an int64 var; `width` a
    multiple of `lanes`), with a [width] multiplier parameter after x where `smoothed`."""
    i64 = lambda value: tirx.IntImm("int64", value)  # noqa: E731
    vectors = width // lanes
    chains = next(c for c in (CHAINS, 2, 1) if vectors % c == 0)
    M = i64(rows) if isinstance(rows, int) else rows
    K, V, U, C = i64(width), i64(lanes), i64(chains), i64(vectors // chains)
    zero_f, tiny, top = (tirx.const(v, "float32") for v in (0.0, 1e-30, float(ACTIVATION_CODES)))

    def value(x, multiplier, m, k):
        """x[m, k], times the multiplier where the kernel is `smoothed`."""
        return x[m, k] * tirx.BufferLoad(multiplier, [k]) if smoothed else x[m, k]

    def code(element, inverse, zero_point):
        """The element's code before the clamp to [0, 255]."""
        return T.round(element * inverse) + T.Cast("float32", zero_point)

    @T.macro
    def quantize_row(x, multiplier, q, scale, zero, m):
        low = T.alloc_buffer((U, V), "float32", scope="local")
        high = T.alloc_buffer((U, V), "float32", scope="local")
        for u in T.unroll(U):
            for lane in T.vectorized(V):
                low[u, lane] = zero_f
                high[u, lane] = zero_f
        for c in T.serial(C):
            for u in T.unroll(U):
                for lane in T.vectorized(V):
                    low[u, lane] = T.min(low[u, lane], value(x, multiplier, m, (c * U + u) * V + lane))
                    high[u, lane] = T.max(high[u, lane], value(x, multiplier, m, (c * U + u) * V + lane))
        for u in T.unroll(U - i64(1)):
            for lane in T.vectorized(V):
                low[i64(0), lane] = T.min(low[i64(0), lane], low[u + i64(1), lane])
                high[i64(0), lane] = T.max(high[i64(0), lane], high[u + i64(1), lane])
        bounds = T.alloc_buffer((i64(2),), "float32", scope="local")
        bounds[0] = low[i64(0), i64(0)]
        bounds[1] = high[i64(0), i64(0)]
        for lane in T.unroll(V - i64(1)):
            bounds[0] = T.min(bounds[0], low[i64(0), lane + i64(1)])
            bounds[1] = T.max(bounds[1], high[i64(0), lane + i64(1)])
        step = T.alloc_buffer((i64(2),), "float32", scope="local")  # the scale and its reciprocal
        step[0] = T.max(bounds[1] - bounds[0], tiny) / top
        step[1] = T.float32(1) / step[0]
        scale[m] = step[0]
        zero[m] = T.Cast("int32", T.round(-bounds[0] * step[1]))
        for c in T.serial(K // V):
            for lane in T.vectorized(V):
                q[m, c * V + lane] = T.Cast(ACTIVATION, T.min(T.max(
                    code(value(x, multiplier, m, c * V + lane), step[1], zero[m]), zero_f), top))

    @script.prim_func(s_tir=True)
    def quantize_rows(x: T.Buffer((M, K), "float32"), multiplier: T.Buffer((K,), "float32"),
                      q: T.Buffer((M, K), ACTIVATION), scale: T.Buffer((M,), "float32"), zero: T.Buffer((M,), "int32")):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):  # Relax's pattern analyses expect a root block
            for m in T.parallel(M):
                quantize_row(x, multiplier, q, scale, zero, m)

    return quantize_rows if smoothed else without_param(quantize_rows, "multiplier")


def schedule_row_quantize(func: tirx.PrimFunc, lanes: int) -> s_tir.Schedule | None:
    """`write_row_quantize`'s kernel in place of `quantize_rows_te`'s PrimFunc (same parameters,
    same values), or None for any other PrimFunc or a row width the lanes do not divide."""
    if len(func.params) not in (4, 5) or func.params[-3].ty.dtype != ACTIVATION:
        return None  # not a quantizer: asked of every PrimFunc, so decided before building a Schedule
    sch = s_tir.Schedule(func)
    names = {sch.get(block).name_hint for block in root_blocks(sch)}
    smoothed = _SMOOTHED in names
    if names - {_SMOOTHED} != _BLOCKS or len(func.params) != 4 + smoothed:
        return None
    rows, width = func.params[0].ty.shape
    if not isinstance(width, tirx.IntImm) or int(width) % lanes:
        return None
    written = write_row_quantize(rows if isinstance(rows, tirx.Var) else int(rows), int(width), lanes, smoothed)
    return s_tir.Schedule(prescheduled(written.with_attrs(func.attrs)))
