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
from .combine import concat_passes
from .combine_batched import BatchParallelLinears

Strategy = Literal["concat", "batched", "off"]
STRATEGIES: tuple[Strategy, ...] = ("concat", "batched", "off")


def strategy_passes(strategy: Strategy) -> list[tvm.transform.Pass]:
    """Canonicalise (so the patterns match), then combine parallel matmuls the chosen way."""
    combine = {"concat": concat_passes,
               "batched": lambda: [BatchParallelLinears(), relax.transform.ReorderPermuteDimsAfterConcat()],
               "off": list}
    return [canonicalize(), *combine[strategy]()]


def apply_strategy(mod: tvm.IRModule, strategy: Strategy) -> tvm.IRModule:
    """`mod` with `strategy_passes` applied."""
    return tvm.transform.Sequential(strategy_passes(strategy), name=f"Combine_{strategy}")(mod)
