"""Relax-to-Relax rewrites of the imported model, one per module, each a `tvm.transform.Pass`
(CamelCase factories, as TVM names its own), composed per strategy into one sequence by
compile/phases/transform.py (`compile_sequence`): `canonicalize` and the matmul-combining `strategy`
(`combine`, `combine_batched`), `sparsity`, `precision` (CUDA dtypes), `smooth` + `quantize` or
`bf16` (the CPU's linear precision), `packing`, then `lift` (weight-only work done once, at compile
time); per bucket, `specialize` rewrites our kernels for its static shapes, and each CPU library's
build runs `fuse_attention`. `linears` finds the linear layers the weight passes rewrite, and
rewrites them.
"""

from __future__ import annotations

from typing import Callable

import tvm


def as_pass(name: str, rewrite: Callable[[tvm.IRModule], tvm.IRModule]) -> tvm.transform.Pass:
    """A module-level rewrite as a named module pass (what a sequence runs and its instrument records)."""
    return tvm.transform.module_pass(lambda mod, _ctx: rewrite(mod), opt_level=0, name=name)
