"""Finding BERT's linear layers in an imported Relax `main`: `matmul(x, permute_dims(W))`."""

from __future__ import annotations

from typing import Iterator

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
