"""Reduced precision for CUDA builds.

The torch importer pins every matmul's out_dtype to float32, so a half-precision export does
not type-check; instead we import in float32 and let ToMixedPrecision cast compute and weights
to float16 (the weight casts are then lifted and done once, at compile time).
"""

from __future__ import annotations

import tvm
from tvm import relax


def precision_passes(dtype: str) -> list[tvm.transform.Pass]:
    """What casts a float32 import to `dtype` (nothing for float32)."""
    return [] if dtype == "float32" else [relax.transform.ToMixedPrecision(out_dtype=dtype)]
