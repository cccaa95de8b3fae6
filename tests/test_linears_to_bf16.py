"""LinearsToBF16: a linear on bf16 panels [N / 32, K / 2, 32, 2] (rounded in the weight-only part of
`main`, so at compile time) and bf16 activations (per call), accumulated in fp32."""

import tvm
from test_pack_linear_weights import linear_module
from tvm import relax
from tvm.script import relax as R

from compile.kernels import bf16
from compile.passes.bf16 import LinearsToBF16


def test_a_linear_runs_on_bf16_panels():
    k, n = 16, 64
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var("w", R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            bits = builder.emit_te(bf16.to_bf16_te, w, primfunc_name_hint=bf16.TO_BF16)
            panels = builder.emit(relax.op.permute_dims(relax.op.reshape(bits, (n // 32, 32, k // 2, 2)), [0, 2, 1, 3]))
            rows = builder.emit_te(bf16.to_bf16_te, x, primfunc_name_hint=bf16.TO_BF16)
            y = builder.emit_output(builder.emit_te(bf16.bf16_matmul_te, rows, panels, primfunc_name_hint=bf16.MATMUL))
        builder.emit_func_output(y)
    tvm.ir.assert_structural_equal(LinearsToBF16()(linear_module(k, n)), builder.get())


def test_a_linear_off_the_panels_stays_fp32():
    before = linear_module(16, 48)  # 48 outputs: not a whole number of 32-wide panels
    tvm.ir.assert_structural_equal(LinearsToBF16()(before), before)
