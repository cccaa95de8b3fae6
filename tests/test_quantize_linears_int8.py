"""QuantizeLinearsInt8: a linear on int8 weight panels (scaled per output channel, in the weight-only part
of `main`: at compile time) and per-token uint8 activations (per call), on the target's micro-kernel."""

import tvm
from test_pack_linear_weights import linear_module
from tvm import relax
from tvm.script import relax as R

from compile.build import make_target
from compile.kernels import int8, row_quantize
from compile.passes.quantize import QuantizeLinearsInt8

VNNI = make_target("cpu", mcpu="cascadelake")  # AVX-512 VNNI, no AMX: one code per weight, no int16 pairs


def test_a_linear_runs_on_int8_panels():
    k, n = 64, 96
    kernel = int8.kernel_for(VNNI)
    panel, group, op = int8.panel_width(kernel, n, False), kernel.group, relax.op
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var("w", R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            largest = op.maximum(op.max(op.abs(w), axis=1), relax.const(1e-30, "float32"))
            scale = builder.emit(op.divide(largest, relax.const(127.0, "float32")))
            codes = builder.emit(op.astype(op.clip(op.round(op.divide(w, op.expand_dims(scale, 1))), -127, 127), "int8"))
            panels = builder.emit(op.permute_dims(op.reshape(codes, (n // panel, panel, k // group, group)), [0, 2, 1, 3]))
            column_sum = builder.emit(op.sum(op.astype(codes, "int32"), axis=1))
            rows = builder.emit_te(row_quantize.quantize_rows_te, x, primfunc_name_hint=row_quantize.ROW_QUANTIZE)
            y = builder.emit_te(int8.int8_matmul_te, *(relax.TupleGetItem(rows, i) for i in range(3)), panels, scale,
                                column_sum, primfunc_name_hint=int8.matmul_name(kernel))
            y = builder.emit_output(y)
        builder.emit_func_output(y)
    tvm.ir.assert_structural_equal(QuantizeLinearsInt8(VNNI)(linear_module(k, n)), builder.get())


def test_a_kept_linear_stays_fp32():
    before = linear_module(64, 96, weight="p_layer_0_output_dense_weight")
    kept = QuantizeLinearsInt8(VNNI, keep=frozenset({"layer_0_output_dense"}))
    tvm.ir.assert_structural_equal(kept(before), before)
