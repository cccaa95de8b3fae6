"""Re-writing our TE kernels for the shapes a bucket binds (after `BindSymbolicVars`)."""

from __future__ import annotations

import tvm
from tvm import relax

from ..kernels import bf16, dense, int8, row_quantize

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")

# Our TE kernels, by name: the function that writes one, and how many tensor arguments it takes
# (then come the shape vars the call passes along).
TE_KERNELS = {dense.KERNEL_NAME: (dense.packed_matmul_te, 2), **int8.te_kernels(),
              **row_quantize.te_kernels(), **bf16.te_kernels()}


@relax.expr_functor.mutator
class _RespecializeKernels(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if call.op == _CALL_TIR:
            for name, (write, tensors) in TE_KERNELS.items():
                if call.args[0].name_hint.startswith(name):
                    inputs = (self.visit_expr(arg) for arg in call.args[1].fields[:tensors])
                    # the call itself, not an emitted var: its binding keeps the original var, so no
                    # `lv = lv_new` alias is left between the kernel and its epilogue (FuseOps stops at one)
                    return self.builder_.call_te(write, *inputs, primfunc_name_hint=name)
        return super().visit_call_(call)


def specialize_te_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite each of our TE kernels (packed, int8 and bf16 matmuls) for the shapes `main` now calls it with.

    The kernels are written over `main`'s symbolic shapes; after BindSymbolicVars gives a bucket
    static shapes, FuseOps/FuseTIR refuse a symbolic kernel fed static tensors (LegalizeOps,
    which writes the other kernels, runs after the binding and has no such problem).
    """
    mutator = _RespecializeKernels(mod)
    mutator.builder_.update_func(mod.get_global_var("main"), mutator.visit_expr(mod["main"]))
    return relax.transform.DeadCodeElimination(["main"])(mutator.builder_.get())
