"""Weights packed once, at load, into the panel layout the CPU matmul kernel streams.

The CPU schedule (`kernels.dense.schedule_matmul`) computes each [M, nt] column tile of
`x @ W^T` from a [K, nt] panel of the weight. With the weight as a plain [K, N] matrix, each
parallel task copied its panel out of it on every call (and for small M, where the copy does not
pay, read it with a stride of N). This pass rewrites `matmul(x, permute_dims(W))`, for weights
computed from parameters only, to a matmul over `Wp[N / nt, K, nt]` (each panel contiguous) and
puts the packing into the weight-only part of `main`, so `LiftTransformParams` moves it into
`main_transform_params`: it runs once, at compile time, and the artifact ships packed weights.
The kernel stays a plain TE compute (not pre-scheduled), so FuseOps still fuses the bias, GELU
and residual epilogues into it and the schedule rule recognises it like any other matmul.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..kernels import dense
from ..kernels.dense import packed_matmul_te, packed_panel_width
from . import as_pass
from .linears import bindings, rewrite_linears, transposed_linears


def linears_on_weights(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """{matmul var: W} for `matmul(x [M, K], permute_dims(W))` where W [N, K] is computed from
    parameters only (a weight, or the concatenation of Q, K and V weights)."""
    num_input = int(func.attrs["num_input"]) if "num_input" in func.attrs else 0
    weights = set(func.params[num_input:])
    value = bindings(func)

    def weight_only(expr: relax.Expr) -> bool:
        free = relax.analysis.free_vars(expr)
        return all(var in weights or (var in value and weight_only(value[var])) for var in free)

    found = {}
    for var, lhs, _, weight in transposed_linears(value):
        shape = weight.ty.shape
        if (len(lhs.ty.shape) == 2 and len(shape) == 2 and all(isinstance(d, tirx.IntImm) for d in shape)
                and lhs.ty.dtype == weight.ty.dtype == var.ty.dtype and weight_only(weight)):
            found[var] = weight
    return found


def pack_linear_weights(mod: tvm.IRModule, lanes: int) -> tuple[tvm.IRModule, int]:
    """`mod` with `main`'s linears over packed weights, and how many were rewritten.

    Run on a module whose weights are still parameters of `main`, before LiftTransformParams.
    A weight whose N the kernel's panel width does not divide stays as it is.
    """
    def pack(builder: relax.BlockBuilder, x: relax.Expr, weight: relax.Expr, n: int, k: int) -> relax.Expr | None:
        nt = packed_panel_width(n, lanes)
        if nt is None:
            return None
        panels = builder.emit(relax.op.permute_dims(relax.op.reshape(weight, (n // nt, nt, k)), [0, 2, 1]))
        # emit_te writes the kernel over the activation's own symbolic shape (batch * seq, K)
        return builder.emit_te(packed_matmul_te, x, panels, primfunc_name_hint=dense.KERNEL_NAME)

    return rewrite_linears(mod, linears_on_weights(mod["main"]), pack)


def PackLinearWeights(lanes: int) -> tvm.transform.Pass:
    """`pack_linear_weights` as a pass."""
    return as_pass("PackLinearWeights", lambda mod: pack_linear_weights(mod, lanes)[0])
