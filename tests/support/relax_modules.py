"""Small hand-written Relax modules that several test files rewrite, schedule and run."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
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


@tvm.script.ir_module
class UnequalWidths:
    """Two linears on one input with different output widths (8 and 4)."""

    @R.function
    def main(x: R.Tensor((6, 8), "float32"), wa: R.Tensor((8, 8), "float32"), ba: R.Tensor((8,), "float32"),
             wb: R.Tensor((4, 8), "float32"), bb: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            a = R.add(R.matmul(x, R.permute_dims(wa)), ba)
            b = R.add(R.matmul(x, R.permute_dims(wb)), bb)
            out = (a, b)
            R.output(out)
        return out


def linear_module(k: int, n: int, weight: str = "w") -> tvm.IRModule:
    """`y = x @ W^T` for x [6, k], W [n, k] (a parameter named `weight`): the other linear passes' Before too."""
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var(weight, R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            y = builder.emit_output(relax.op.matmul(x, builder.emit(relax.op.permute_dims(w))))
        builder.emit_func_output(y)
    return builder.get()


def calls_of(mod: tvm.IRModule, op_name: str) -> list[relax.Call]:
    """The calls of the op `op_name` (e.g. "relax.matmul") in `mod`'s main."""
    found = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: found.append(e) if isinstance(e, relax.Call) and getattr(e.op, "name", "") == op_name else None,
    )
    return found


def dense_module(m, k: int, n: int, epilogue: str = "bias") -> tvm.IRModule:
    """x[m, k] @ w[k, n] + b, then an optional GELU or residual-add-and-scale epilogue."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    r = relax.Var("r", relax.TensorType((m, n), "float32"))
    params = [x, w, b] + ([r] if epilogue == "residual" else [])
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
            if epilogue == "gelu":
                y = bb.emit(relax.op.nn.gelu(y))
            elif epilogue == "residual":
                y = bb.emit(relax.op.multiply(relax.op.add(y, r), relax.const(0.5, "float32")))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def layer_norm_module(m, width: int) -> tvm.IRModule:
    """layer_norm(x[m, width]) with its own gamma and beta."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, width), "float32"))
    gamma, beta = (relax.Var(name, relax.TensorType((width,), "float32")) for name in ("g", "be"))
    with bb.function("main", [x, gamma, beta]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=1e-12)))
        bb.emit_func_output(out)
    return bb.get()


def attention_module(heads: int, d: int, static_seq: int | None = None) -> tvm.IRModule:
    """softmax(q @ k^T * scale) @ v on [batch * heads, seq, d], seq symbolic unless given."""
    bh = tirx.Var("bh", "int64")
    s = static_seq or tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((bh, s, d), "float32"))
    kt = relax.Var("kt", relax.TensorType((bh, d, s), "float32"))
    v = relax.Var("v", relax.TensorType((bh, s, d), "float32"))
    with bb.function("main", [q, kt, v]):
        with bb.dataflow():
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, kt), relax.const(d**-0.5, "float32")))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(relax.op.matmul(probs, v))
        bb.emit_func_output(out)
    return bb.get()
