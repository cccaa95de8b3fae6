"""The batched strategy for parallel linear layers: one batch matmul over stacked weights.

Branches `y_i = x @ W_i^T + b_i` sharing `x [M, K]`, with equal `W_i [N, K]`, become
`Y = matmul(x, stack(W_i^T)) + stack(b_i)[:, None, :]` (`[B, M, N]`, `x` broadcast over B)
and `y_i = Y[i]`. This is Relay's CombineParallelDense on Relax; unlike the concat strategy
it needs equal widths, so groups of unequal widths are refused and left alone.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import tvm
from tvm import relax

from . import as_pass

_MATMUL = tvm.ir.Op.get("relax.matmul")
_ADD = tvm.ir.Op.get("relax.add")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")


@dataclass(frozen=True)
class LinearBranch:
    output: relax.Var  # what later bindings read: the bias add if there is one, else the matmul
    matmul: relax.Var
    lhs: relax.Var  # the shared input
    weight: relax.Var  # the [N, K] parameter, before its transpose
    bias: relax.Var | None


def _is_call(expr, op) -> bool:
    return isinstance(expr, relax.Call) and expr.op == op


def _shape(var: relax.Var) -> tuple:
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in var.ty.shape)


def find_parallel_linears(func: relax.Function) -> list[list[LinearBranch]]:
    """Groups (>= 2) of `matmul(x, permute_dims(W)) [+ b]` with the same `x`, W and b parameters."""
    bindings = [b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    value = {b.var: b.value for b in bindings}
    params = set(func.params)
    uses: Counter = Counter()
    for expr in [*value.values(), func.body.body]:
        relax.analysis.post_order_visit(expr, lambda e: uses.update([e]) if isinstance(e, relax.Var) else None)
    bias_add = {
        call.args[0]: var
        for var, call in value.items()
        if _is_call(call, _ADD) and call.args[1] in params and len(call.args[1].ty.shape) == 1
    }
    groups: dict[relax.Var, list[LinearBranch]] = defaultdict(list)
    for var, call in value.items():
        if not _is_call(call, _MATMUL):
            continue
        lhs, rhs = call.args
        transpose = value.get(rhs)
        if not (_is_call(transpose, _PERMUTE) and transpose.args[0] in params and len(transpose.args[0].ty.shape) == 2):
            continue
        add = bias_add.get(var) if uses[var] == 1 else None
        bias = value[add].args[1] if add is not None else None
        groups[lhs].append(LinearBranch(add if add is not None else var, var, lhs, transpose.args[0], bias))
    return [branches for branches in groups.values() if len(branches) > 1]


def batchable(branches: list[LinearBranch]) -> bool:
    """Equal weight shapes, and either every branch has a bias or none has."""
    return len({_shape(b.weight) for b in branches}) == 1 and len({b.bias is None for b in branches}) == 1


@relax.expr_functor.mutator
class _BatchParallelLinears(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, groups: list[list[LinearBranch]]):
        super().__init__(mod)
        self.group_at = {branches[0].matmul: branches for branches in groups}
        self.dropped = {v for branches in groups for b in branches for v in (b.matmul, b.output)}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.group_at:
            self._emit_batched(self.group_at[binding.var])
        elif binding.var not in self.dropped:
            super().visit_var_binding_(binding)

    def _emit_batched(self, branches: list[LinearBranch]) -> None:
        emit = self.builder_.emit
        lhs = self.visit_expr(branches[0].lhs)
        # Broadcast the shared input explicitly: [B, M, K] x [B, K, N] is a plain batch matmul,
        # which the CPU and GPU matmul schedules recognise (a broadcast LHS is not).
        shape = [len(branches), *lhs.ty.shape]
        lhs = emit(relax.op.broadcast_to(relax.op.expand_dims(lhs, axis=0), relax.ShapeExpr(shape)))
        weights = emit(relax.op.stack([relax.op.permute_dims(b.weight) for b in branches], axis=0))
        stacked = emit(relax.op.matmul(lhs, weights))
        if branches[0].bias is not None:
            biases = relax.op.expand_dims(relax.op.stack([b.bias for b in branches], axis=0), axis=1)
            stacked = emit(relax.op.add(stacked, emit(biases)))
        parts = emit(relax.op.split(stacked, len(branches), axis=0))
        for index, branch in enumerate(branches):
            part = relax.op.squeeze(relax.TupleGetItem(parts, index), axis=[0])
            is_output = not isinstance(branch.output, relax.DataflowVar)
            self.set_var_remap(branch.output, (self.builder_.emit_output if is_output else emit)(part))


@dataclass
class BatchedResult:
    mod: tvm.IRModule
    combined_groups: int
    refused_groups: int


def batch_parallel_linears(mod: tvm.IRModule) -> BatchedResult:
    """Apply the batched strategy to `main`; report how many groups were combined and refused."""
    groups = find_parallel_linears(mod["main"])
    accepted = [g for g in groups if batchable(g)]
    mutator = _BatchParallelLinears(mod, accepted)
    gvar = mod.get_global_var("main")
    mutator.builder_.update_func(gvar, mutator.visit_expr(mod["main"]))
    cleaned = tvm.transform.Sequential(
        [relax.transform.DeadCodeElimination(["main"]), relax.transform.CanonicalizeBindings()]
    )(mutator.builder_.get())
    return BatchedResult(cleaned, len(accepted), len(groups) - len(accepted))


def BatchParallelLinears() -> tvm.transform.Pass:
    """`batch_parallel_linears` as a pass."""
    return as_pass("BatchParallelLinears", lambda mod: batch_parallel_linears(mod).mod)
