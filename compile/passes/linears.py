"""Finding BERT's linear layers in an imported Relax `main`: `matmul(x, permute_dims(W))`."""

from __future__ import annotations

from typing import Callable, Iterator

import tvm
from tvm import relax

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")


def bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """Every variable of `func`'s body and the value bound to it."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}


def transposed_linears(value: dict[relax.Var, relax.Expr]) -> Iterator[tuple[relax.Var, relax.Expr, relax.Var, relax.Expr]]:
    """(output var, x, permute var, W) for each `matmul(x, permute_dims(W))` with a plain 2-D transpose."""
    for var, call in value.items():
        if not (isinstance(call, relax.Call) and call.op == _MATMUL):
            continue
        lhs, rhs = call.args
        permute = value.get(rhs)
        if (isinstance(permute, relax.Call) and permute.op == _PERMUTE
                and (permute.attrs.axes is None or [int(a) for a in permute.attrs.axes] == [1, 0])):
            yield var, lhs, rhs, permute.args[0]


# rewrite(builder, x, W, n, k) -> the linear's new output, or None to leave it as it is
LinearRewrite = Callable[[relax.BlockBuilder, relax.Expr, relax.Expr, int, int], "relax.Expr | None"]


@relax.expr_functor.mutator
class _RewriteLinears(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, linears: dict[relax.Var, relax.Expr], rewrite: LinearRewrite):
        super().__init__(mod)
        self.linears = linears
        self.rewrite = rewrite
        self.rewritten = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        weight = self.linears.get(binding.var)
        output = None
        if weight is not None:
            n, k = (int(d) for d in weight.ty.shape)
            output = self.rewrite(self.builder_, self.visit_expr(binding.value.args[0]), self.visit_expr(weight), n, k)
        if output is None:
            super().visit_var_binding_(binding)
            return
        if not isinstance(binding.var, relax.DataflowVar):
            output = self.builder_.emit_output(output)
        self.set_var_remap(binding.var, output)
        self.rewritten += 1


def rewrite_linears(mod: tvm.IRModule, linears: dict[relax.Var, relax.Expr],
                    rewrite: LinearRewrite) -> tuple[tvm.IRModule, int]:
    """`mod` with each of `main`'s `linears` ({matmul var: W}) replaced by what `rewrite` emits
    for it, and how many were replaced. The weight-side ops it emits stay in the weight-only part
    of `main`, so LiftTransformParams runs them once, at compile time."""
    mutator = _RewriteLinears(mod, linears, rewrite)
    mutator.builder_.update_func(mod.get_global_var("main"), mutator.visit_expr(mod["main"]))
    return relax.transform.DeadCodeElimination(["main"])(mutator.builder_.get()), mutator.rewritten
