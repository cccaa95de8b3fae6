"""Small hand-written Relax modules that several test files rewrite and run."""

import tvm
from tvm.script import relax as R


@tvm.script.ir_module
class BiasFirstQKV:
    """The importer's shape of a Q/K/V block: bias-first adds, one reshape per branch."""

    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32"), wq: R.Tensor((8, 8), "float32"), bq: R.Tensor((8,), "float32"),
             wk: R.Tensor((8, 8), "float32"), bk: R.Tensor((8,), "float32"),
             wv: R.Tensor((8, 8), "float32"), bv: R.Tensor((8,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            xq = R.reshape(x, (8, 8))
            q = R.add(bq, R.matmul(xq, R.permute_dims(wq)))
            xk = R.reshape(x, (8, 8))
            k = R.add(bk, R.matmul(xk, R.permute_dims(wk)))
            xv = R.reshape(x, (8, 8))
            v = R.add(bv, R.matmul(xv, R.permute_dims(wv)))
            out = (q, k, v)
            R.output(out)
        return out
