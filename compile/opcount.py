"""Counting Relax operators in a function: how the pass tests and the manifest see a pass's effect."""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

TRACKED_OPS = ("relax.matmul", "relax.concat", "relax.permute_dims")


def count_ops(mod: tvm.IRModule, function: str = "main") -> Counter:
    """Number of calls to each Relax operator bound in `function`."""
    counts: Counter = Counter()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            counts[expr.op.name] += 1

    relax.analysis.post_order_visit(mod[function].body, visit)
    return counts


def tracked_counts(mod: tvm.IRModule, function: str = "main") -> dict[str, int]:
    counts = count_ops(mod, function)
    return {name.removeprefix("relax."): counts[name] for name in TRACKED_OPS}
