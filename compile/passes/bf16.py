"""`--precision bf16`: every linear layer over bf16 weights, fp32 accumulation (AVX512_BF16 CPUs).

The pass rewrites `matmul(x, permute_dims(W))`, for weights computed from parameters only (as
compile/passes/packing.py finds them, Q/K/V concatenations included), into

    panels = bf16(W) in the kernel's [N / 32, K / 2, 32, 2] layout   (compile time, round to nearest even)
    xb     = bf16(x)                                                 (run time, per call)
    y      = bf16_matmul(xb, panels)                                 (fp32 accumulation, compile/kernels/bf16.py)

The weight-side ops sit in the weight-only part of `main`, so LiftTransformParams runs them at
compile time and the artifact ships the bf16 panels (half the bytes of fp32). Attention, layer
norm, softmax, GELU and pooling stay fp32; the kernels are TE computes, so FuseOps still fuses the
bias / GELU / residual epilogue into the matmul.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..kernels import bf16
from . import as_pass
from .linears import rewrite_linears
from .packing import linears_on_weights

SCHEME = "bf16: weights rounded to bf16 at compile time, activations per call, fp32 accumulation"


def convertible(n: int, k: int) -> bool:
    """Whether a linear of N outputs and K inputs fits the kernel's panels without padding."""
    return n % bf16.PANEL == 0 and k % bf16.PAIR == 0


def bf16_linear(builder: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, n: int, k: int) -> relax.Expr | None:
    """One linear on bf16 panels (a `rewrite_linears` rewrite; None where it does not fit them)."""
    if not convertible(n, k):
        return None
    bits = builder.emit_te(bf16.to_bf16_te, w, primfunc_name_hint=bf16.TO_BF16)
    panels = builder.emit(relax.op.permute_dims(
        relax.op.reshape(bits, (n // bf16.PANEL, bf16.PANEL, k // bf16.PAIR, bf16.PAIR)), [0, 2, 1, 3]))
    rows = builder.emit_te(bf16.to_bf16_te, x, primfunc_name_hint=bf16.TO_BF16)
    return builder.emit_te(bf16.bf16_matmul_te, rows, panels, primfunc_name_hint=bf16.MATMUL)


def linears_to_bf16(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """`mod` with `main`'s linears on bf16 weights, and how many were rewritten (run before
    LiftTransformParams and before compile/passes/packing.py, which packs what is left in fp32)."""
    return rewrite_linears(mod, linears_on_weights(mod["main"]), bf16_linear)


def LinearsToBF16() -> tvm.transform.Pass:
    """`linears_to_bf16` as a pass."""
    return as_pass("LinearsToBF16", lambda mod: linears_to_bf16(mod)[0])
