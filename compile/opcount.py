"""Counting Relax operators in a function: how the pass tests and the manifest see a pass's effect
(`PassRecorder`, the instrument a compile's pass sequence runs under)."""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

TRACKED_OPS = ("relax.matmul", "relax.concat", "relax.permute_dims")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


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


def kernel_calls(mod: tvm.IRModule, prefix: str, function: str = "main") -> int:
    """Calls in `function` to PrimFuncs named `prefix`... (our TE kernels: how many linears a pass put on them)."""
    calls = [0]

    def visit(expr: relax.Expr) -> None:
        if (isinstance(expr, relax.Call) and expr.op == _CALL_TIR
                and expr.args[0].name_hint.startswith(prefix)):
            calls[0] += 1

    relax.analysis.post_order_visit(mod[function].body, visit)
    return calls[0]


@tvm.instrument.pass_instrument
class PassRecorder:
    """Records the passes a sequence runs (its own, not theirs: nested passes are theirs) and the
    tracked op counts of `main` before the first and after each."""

    def __init__(self):
        self.depth = 0
        self.before: dict[str, int] | None = None
        self.after: list[tuple[str, dict[str, int]]] = []  # (pass name, counts after it), in order

    def run_before_pass(self, mod: tvm.IRModule, _info: tvm.transform.PassInfo) -> None:
        if self.depth == 1 and self.before is None:
            self.before = tracked_counts(mod)
        self.depth += 1

    def run_after_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        self.depth -= 1
        if self.depth == 1:
            self.after.append((info.name, tracked_counts(mod)))

    def names(self) -> list[str]:
        return [name for name, _ in self.after]
