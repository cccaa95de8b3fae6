"""How parallel matmuls are combined: concat (one wide matmul), batched (one batch matmul) or off.

Which is faster depends on shapes and backend (on CUDA, one concatenated cuBLAS GEMM has been
seen to beat a strided batched one for B=3), so `auto` builds every bucket each way, times the
libraries on the target device and keeps the fastest.
"""

from __future__ import annotations

from typing import Literal

import tvm
from tvm import relax

from .canonicalize import canonicalize
from .combine import combine_parallel_matmuls
from .combine_batched import batch_parallel_linears

Strategy = Literal["concat", "batched", "off"]
STRATEGIES: tuple[Strategy, ...] = ("concat", "batched", "off")

PASSES = {
    "concat": ["CanonicalizeForCombine", "CombineParallelMatmul", "ReorderPermuteDimsAfterConcat", "LiftTransformParams"],
    "batched": ["CanonicalizeForCombine", "BatchParallelLinears", "ReorderPermuteDimsAfterConcat", "LiftTransformParams"],
    "off": ["CanonicalizeForCombine", "LiftTransformParams"],
}


def apply_strategy(mod: tvm.IRModule, strategy: Strategy) -> tvm.IRModule:
    """Canonicalise (so the patterns match), then combine parallel matmuls the chosen way."""
    mod = canonicalize()(mod)
    if strategy == "concat":
        return combine_parallel_matmuls()(mod)
    if strategy == "batched":
        return relax.transform.ReorderPermuteDimsAfterConcat()(batch_parallel_linears(mod).mod)
    return mod
