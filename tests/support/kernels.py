"""Operands of the kernels in compile/kernels/ as tests build them (the int8 linears' placeholders
and weights, attention's heads and padding bias), and what a kernel prefetches."""

from __future__ import annotations


def int8_linear_inputs(m, n: int, k: int, kernel, panel: int | None = None) -> list:
    """The placeholders of `int8.int8_matmul_te` for M rows (an int or a var), N outputs and K inputs (the
    activations' dims int64, as Relax writes them), on panels `panel` columns wide (default: the kernel's)."""
    from tvm import te, tirx

    from compile.kernels import int8

    panel = panel or kernel.panel
    return [te.placeholder((m, tirx.IntImm("int64", k)), int8.ACTIVATION, name="xq"),
            te.placeholder((m,), "float32", name="scale"), te.placeholder((m,), "int32", name="zero"),
            te.placeholder((n // panel, k // kernel.group, panel, kernel.group), "int8", name="panels"),
            te.placeholder((n,), "float32", name="weight_scale"), te.placeholder((n,), "int32", name="column_sum")]


def int8_weight_operands(quantized, kernel, panel: int | None = None) -> tuple:
    """(panels, column sums) of int8 weights [N, K] in `kernel`'s layout, `panel` columns a panel (default:
    the kernel's), as the int8 pass writes them."""
    import numpy as np

    n, k = quantized.shape
    panel = panel or kernel.panel
    panels = quantized.reshape(n // panel, panel, k // kernel.group, kernel.group).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(panels), quantized.astype(np.int32).sum(axis=1).astype(np.int32)


def prefetched_addresses(func) -> list:
    """The indices of every address `func` prefetches (compile/kernels/common.prefetch_next_panel)."""
    import tvm
    import tvm_ffi

    prefetch, indices = tvm.ir.Op.get("tirx.prefetch"), []
    tvm_ffi.structural_walk(func, [(tvm.ir.expr.Call, lambda call: indices.append(
        list(call.args[0].args[0].indices)) if call.op.same_as(prefetch) else None)])
    return indices


def prefetch_guards(func) -> list:
    """For every prefetch of `func`, the loop whose first iteration alone issues it (the For of `v` in
    an `if v == 0` around it), or None where no such `if` guards it."""
    import tvm_ffi
    from tvm import tirx

    loops, guards = {}, []
    tvm_ffi.structural_walk(func, [(tirx.For, lambda loop: loops.update({loop.loop_var: loop}))])

    def guard(branch):
        condition = branch.condition
        first = (isinstance(condition, tirx.EQ) and isinstance(condition.b, tirx.IntImm)
                 and int(condition.b) == 0 and isinstance(condition.a, tirx.Var))
        if first:  # other branches around prefetches (a claimed loop's) guard every iteration alike
            guards.extend([loops.get(condition.a)] * len(prefetched_addresses(branch.then_case)))

    tvm_ffi.structural_walk(func, [(tirx.IfThenElse, guard)])
    return guards + [None] * (len(prefetched_addresses(func)) - len(guards))


def key_padding_bias(seq: int, length: int):
    """The additive attention bias [1, 1, 1, seq] of one sequence whose keys from `length` on are
    padding (float32's least value, as the wrapper's mask gives them)."""
    import numpy as np

    masked = np.finfo(np.float32).min
    return np.where(np.arange(seq) < length, 0.0, masked).astype(np.float32).reshape(1, 1, 1, seq)


def attention_heads(qkv, heads: int, head_size: int) -> list:
    """Q, K and V of one sequence side by side in `qkv` [seq, 3 x hidden], each as [1, heads, seq,
    head_size] torch tensors, as transformers hands them to its attention."""
    import torch

    hidden = heads * head_size
    return [torch.from_numpy(qkv[:, i * hidden:(i + 1) * hidden]).reshape(1, -1, heads, head_size).transpose(1, 2)
            for i in range(3)]
