"""Combining parallel matmuls that share an input (Q/K/V) into one concatenated matmul."""

from __future__ import annotations

import tvm
from tvm import relax


def concat_passes() -> list[tvm.transform.Pass]:
    """CombineParallelMatmul, then ReorderPermuteDimsAfterConcat.

    The reorder turns `concat(permute_dims(Wq), permute_dims(Wk), ...)` into
    `permute_dims(concat(Wq, Wk, ...))`, so linear-layer kernels still see
    `matmul(x, permute_dims(W))` after combining (apache/tvm#16596).
    """
    return [relax.transform.CombineParallelMatmul(), relax.transform.ReorderPermuteDimsAfterConcat(),
            relax.transform.CanonicalizeBindings()]


def combine_parallel_matmuls() -> tvm.transform.Pass:
    """`concat_passes` as one pass."""
    return tvm.transform.Sequential(concat_passes(), name="CombineParallelMatmuls")
