"""PackLinearWeights: a linear's weight into the CPU kernel's contiguous [N / nt, K, nt] panels, packed in
the weight-only part of `main` (lifted: done once, at compile time)."""

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from compile.kernels import dense
from compile.passes.packing import PackLinearWeights


def linear_module(k: int, n: int, weight: str = "w") -> tvm.IRModule:
    """`y = x @ W^T` for x [6, k], W [n, k] (a parameter named `weight`): the other linear passes' Before too."""
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var(weight, R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            y = builder.emit_output(relax.op.matmul(x, builder.emit(relax.op.permute_dims(w))))
        builder.emit_func_output(y)
    return builder.get()


@pytest.mark.parametrize("lanes", [8, 16])
def test_a_linear_runs_on_packed_panels(lanes):
    k, n = 16, 6 * lanes
    nt = dense.packed_panel_width(n, lanes)
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var("w", R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            panels = builder.emit(relax.op.permute_dims(relax.op.reshape(w, (n // nt, nt, k)), [0, 2, 1]))
            y = builder.emit_output(builder.emit_te(dense.packed_matmul_te, x, panels,
                                                    primfunc_name_hint=dense.KERNEL_NAME))
        builder.emit_func_output(y)
    tvm.ir.assert_structural_equal(PackLinearWeights(lanes)(linear_module(k, n)), builder.get())


def test_a_width_no_panel_divides_is_left_alone():
    before = linear_module(16, 20)
    tvm.ir.assert_structural_equal(PackLinearWeights(16)(before), before)
