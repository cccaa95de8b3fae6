"""Comparing each built library with PyTorch eager on random token batches of its own shape."""

from __future__ import annotations

import numpy as np
import torch

from .bucketing import Bucket
from .importer import example_inputs
from .loader import LibraryRunner


def max_abs_diff(runner: LibraryRunner, wrapper: torch.nn.Module, shape: Bucket, vocab_size: int, seed: int) -> float:
    """Largest |tvm - torch| over one random batch of `shape` (ragged attention mask included)."""
    inputs = example_inputs(shape.batch, shape.seq, vocab_size, seed=seed)
    with torch.no_grad():
        expected = wrapper(*inputs).float().numpy()
    actual = runner(*(x.numpy() for x in inputs))
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.max(np.abs(actual - expected)))
