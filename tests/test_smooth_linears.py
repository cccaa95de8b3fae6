"""SmoothLinears: `x @ W^T` becomes `(x * (1 / s)) @ (W * s)^T` for a linear with a smoothing vector s;
the weight side is weight-only (lifted: folded into the shipped weights)."""

import numpy as np
import tvm
from test_pack_linear_weights import linear_module
from tvm import relax
from tvm.script import relax as R

from compile.passes.smooth import SmoothLinears


def test_a_linear_with_a_scale_is_smoothed():
    k, n = 8, 4
    s = np.linspace(0.5, 4.0, k).astype("float32")
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var("p_up_weight", R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            scaled_x = builder.emit(relax.op.multiply(x, relax.const((1.0 / s).astype("float32"))))
            scaled_w = builder.emit(relax.op.multiply(w, relax.const(s)))
            y = builder.emit_output(builder.emit(relax.op.matmul(scaled_x, relax.op.permute_dims(scaled_w))))
        builder.emit_func_output(y)
    smoothed = SmoothLinears({"up": s})(linear_module(k, n, weight="p_up_weight"))
    tvm.ir.assert_structural_equal(smoothed, builder.get())


def test_a_linear_without_a_scale_is_left_alone():
    before = linear_module(8, 4, weight="p_up_weight")
    tvm.ir.assert_structural_equal(SmoothLinears({"down": np.ones(8, "float32")})(before), before)
