"""Embeddings in the precisions vector databases store: int8, uint8, binary and ubinary, computed as
sentence-transformers' `quantize_embeddings(embeddings, precision, ranges)` computes them. int8 and
uint8 need each output dimension's range: an artifact's own embeddings of the shipped sentences,
recorded in its manifest when it is compiled (`calibration_ranges`)."""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from .manifest import EmbeddingRangesEntry

EmbeddingDtype = Literal["float32", "int8", "uint8", "binary", "ubinary"]
EMBEDDING_DTYPES: tuple[str, ...] = get_args(EmbeddingDtype)
# the precisions whose buckets come from calibration ranges
CALIBRATED_DTYPES = ("int8", "uint8")


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows over their L2 norm (at least 1e-12), as torch.nn.functional.normalize divides them."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def calibration_ranges(embeddings: np.ndarray) -> EmbeddingRangesEntry:
    """The manifest's record of `embeddings` ([sentences, dim], as the libraries return them): per
    dimension their least and greatest value, as they are and L2-normalized, in float32 (what
    `quantize_embeddings` casts ranges to)."""
    embeddings = np.asarray(embeddings, dtype=np.float32)

    def ranges(rows: np.ndarray) -> list[list[float]]:
        return np.stack([rows.min(axis=0), rows.max(axis=0)]).astype(np.float32).tolist()

    return EmbeddingRangesEntry(sentences=len(embeddings), raw=ranges(embeddings),
                                normalized=ranges(l2_normalize(embeddings)))


def quantize(embeddings: np.ndarray, dtype: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """`embeddings` ([n, dim] float32) in `dtype`, as `quantize_embeddings(embeddings, dtype, ranges)`:
    int8 / uint8 the 256 equal buckets of each dimension's `ranges` ([2, dim]: min, max), int8
    shifted by -128; binary / ubinary the signs (> 0) packed 8 to a byte, binary shifted by -128."""
    if dtype == "float32":
        return embeddings.astype(np.float32)
    if dtype in CALIBRATED_DTYPES:
        ranges = np.asarray(ranges).astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if dtype == "uint8" else (buckets - 128).astype(np.int8)
    if dtype == "binary":
        return (np.packbits(embeddings > 0, axis=-1) - 128).astype(np.int8)
    if dtype == "ubinary":
        return np.packbits(embeddings > 0, axis=-1)
    raise ValueError(f"embedding dtype {dtype!r} is none of {', '.join(EMBEDDING_DTYPES)}")
