"""BatchParallelLinears: linears of equal width on one input become one batch matmul over stacked weights."""

import tvm
from test_strategies import UnequalWidths
from tvm.script import relax as R

from compile.passes.combine_batched import BatchParallelLinears


def test_three_biased_linears_of_one_input_become_one_batch_matmul():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), wq: R.Tensor((4, 8), "float32"), bq: R.Tensor((4,), "float32"),
                 wk: R.Tensor((4, 8), "float32"), bk: R.Tensor((4,), "float32"),
                 wv: R.Tensor((4, 8), "float32"), bv: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                q = R.add(R.matmul(x, R.permute_dims(wq)), bq)
                k = R.add(R.matmul(x, R.permute_dims(wk)), bk)
                v = R.add(R.matmul(x, R.permute_dims(wv)), bv)
                out = (q, k, v)
                R.output(out)
            return out

    @tvm.script.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), wq: R.Tensor((4, 8), "float32"), bq: R.Tensor((4,), "float32"),
                 wk: R.Tensor((4, 8), "float32"), bk: R.Tensor((4,), "float32"),
                 wv: R.Tensor((4, 8), "float32"), bv: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lhs = R.broadcast_to(R.expand_dims(x, axis=[0]), R.shape([3, 6, 8]))
                weights = R.stack([R.permute_dims(wq), R.permute_dims(wk), R.permute_dims(wv)], axis=0)
                stacked = R.add(R.matmul(lhs, weights), R.expand_dims(R.stack([bq, bk, bv], axis=0), axis=[1]))
                parts = R.split(stacked, indices_or_sections=3, axis=0)
                q = R.squeeze(parts[0], axis=[0])
                k = R.squeeze(parts[1], axis=[0])
                v = R.squeeze(parts[2], axis=[0])
                out = (q, k, v)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(BatchParallelLinears()(Before), Expected)


def test_linears_of_unequal_widths_are_left_alone():
    tvm.ir.assert_structural_equal(BatchParallelLinears()(UnequalWidths), UnequalWidths)
