"""Canonicalise an imported BERT so that CombineParallelMatmul can fire.

The torch importer emits `add(bias, matmul(x, W))` (bias first), which the combine pass's
pattern does not match, and reshapes the hidden state once per Q/K/V branch, so the three
matmuls do not share one LHS. We put the matmul first in every such add, then let
EliminateCommonSubexpr + CanonicalizeBindings merge the duplicated reshapes.

The importer also emits embedding lookups as `take(..., mode="fast")`, which reads out of
bounds (and can crash the server) on a bad token id; we make them clip instead.
"""

from __future__ import annotations

import tvm
from tvm import relax

_ADD = tvm.ir.Op.get("relax.add")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_TAKE = tvm.ir.Op.get("relax.take")


@relax.expr_functor.mutator
class _MatmulFirstAdd(relax.PyExprMutator):
    """Rewrites add(other, matmul(...)) to add(matmul(...), other) (add is commutative), and
    unchecked gathers to clipped ones."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == _ADD and not self._is_matmul(call.args[0]) and self._is_matmul(call.args[1]):
            return relax.Call(call.op, [call.args[1], call.args[0]], call.attrs, call.ty_args)
        if call.op == _TAKE and call.attrs.mode == "fast":
            return relax.op.take(call.args[0], call.args[1], axis=call.attrs.axis, mode="clip")
        return call

    def _is_matmul(self, expr: relax.Expr) -> bool:
        if isinstance(expr, relax.Var):
            expr = self.lookup_binding(expr)
        return isinstance(expr, relax.Call) and expr.op == _MATMUL


@tvm.transform.module_pass(opt_level=0, name="MatmulFirstAdd")
def matmul_first_add(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Module pass form of the bias-last rewrite, applied to every Relax function."""
    mutator = _MatmulFirstAdd(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def canonicalize() -> tvm.transform.Pass:
    """The full canonicalisation: matmul-first adds, then shared reshapes."""
    return tvm.transform.Sequential(
        [
            matmul_first_add,
            relax.transform.EliminateCommonSubexpr(),
            relax.transform.CanonicalizeBindings(),
        ],
        name="CanonicalizeForCombine",
    )
