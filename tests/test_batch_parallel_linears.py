"""BatchParallelLinears: linears of equal width on one input become one batch matmul over stacked weights."""

import tvm
from tvm.script import relax as R

from compile.passes.combine_batched import BatchParallelLinears


def test_two_biased_linears_of_one_input_become_one_batch_matmul():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), wa: R.Tensor((4, 8), "float32"), ba: R.Tensor((4,), "float32"),
                 wb: R.Tensor((4, 8), "float32"), bb: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                a = R.add(R.matmul(x, R.permute_dims(wa)), ba)
                b = R.add(R.matmul(x, R.permute_dims(wb)), bb)
                out = (a, b)
                R.output(out)
            return out

    @tvm.script.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), wa: R.Tensor((4, 8), "float32"), ba: R.Tensor((4,), "float32"),
                 wb: R.Tensor((4, 8), "float32"), bb: R.Tensor((4,), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lhs = R.broadcast_to(R.expand_dims(x, axis=[0]), R.shape([2, 6, 8]))
                weights = R.stack([R.permute_dims(wa), R.permute_dims(wb)], axis=0)
                stacked = R.matmul(lhs, weights)
                biases = R.expand_dims(R.stack([ba, bb], axis=0), axis=[1])
                biased = R.add(stacked, biases)
                parts = R.split(biased, indices_or_sections=2, axis=0)
                a = R.squeeze(parts[0], axis=[0])
                b = R.squeeze(parts[1], axis=[0])
                out = (a, b)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(BatchParallelLinears()(Before), Expected)


def test_linears_of_unequal_widths_are_left_alone():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((6, 8), "float32"), wa: R.Tensor((8, 8), "float32"), wb: R.Tensor((4, 8), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                a = R.matmul(x, R.permute_dims(wa))
                b = R.matmul(x, R.permute_dims(wb))
                out = (a, b)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(BatchParallelLinears()(Before), Before)
