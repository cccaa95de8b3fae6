"""SparsifyLinears: a linear whose weight is sparse enough in blocks runs on the BSR kernel, its weight
parameter replaced by the three BSR arrays (in the signature and in the weights beside the module)."""

import numpy as np
import tvm
from test_pack_linear_weights import linear_module
from tvm import relax
from tvm.script import relax as R

from compile.build import make_target
from compile.passes.sparsity import SparseWeights, SparsifyLinears, bsr_matmul_func, to_bsr

CPU = make_target("cpu", mcpu="x86-64-v3")
BLOCK = (16, 1)


def _half_zero_blocks(n: int, k: int) -> np.ndarray:
    weight = np.random.default_rng(0).standard_normal((n, k)).astype("float32")
    weight[:16, ::2] = 0.0  # half of the first block row's blocks
    weight[16:, 1::2] = 0.0
    return weight


def test_a_sparse_enough_linear_runs_on_the_bsr_kernel():
    k, n = 8, 32
    weight = _half_zero_blocks(n, k)
    arrays = to_bsr(weight, BLOCK)
    builder = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((6, k), "float32"))
    parts = [relax.Var(f"w_bsr_{part}", relax.TensorType(a.shape, str(a.dtype)))
             for part, a in zip(("data", "indices", "indptr"), arrays)]
    with builder.function("main", [x, *parts], attrs={"num_input": 1}):
        with builder.dataflow():
            kernel = builder.add_func(bsr_matmul_func(k, len(arrays[1]), BLOCK, n // 16, "float32", CPU), "bsr_matmul")
            blocked = builder.emit(relax.call_tir(kernel, [x, *parts], R.Tensor((6, n // 16, 16), "float32")))
            y = builder.emit_output(relax.op.reshape(blocked, (6, n)))
        builder.emit_func_output(y)
    weights = SparseWeights([tvm.runtime.tensor(weight)])
    sparsified = SparsifyLinears(weights, BLOCK, max_density=0.5, target=CPU, timed=False)(linear_module(k, n))
    tvm.ir.assert_structural_equal(sparsified, builder.get())
    assert [w.numpy().tolist() for w in weights.params] == [a.tolist() for a in arrays]
    assert (weights.report["rewritten"], weights.report["kept_dense"], weights.report["density"]) == (1, 0, 0.5)


def test_a_denser_linear_stays_dense():
    before = linear_module(8, 32)
    weights = SparseWeights([tvm.runtime.tensor(_half_zero_blocks(32, 8))])
    tvm.ir.assert_structural_equal(SparsifyLinears(weights, BLOCK, 0.25, CPU, timed=False)(before), before)
    assert (weights.report["rewritten"], weights.report["kept_dense"]) == (0, 1)
