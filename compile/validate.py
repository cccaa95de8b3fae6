"""Comparing each built library with PyTorch eager on random token batches of its own shape."""

from __future__ import annotations

import numpy as np
import torch

from artifact.bucketing import AnyBucket
from artifact.loader import LibraryRunner
from artifact.packed_batch import PACKED_INPUT_NAMES, pack_batch, per_sequence_rows

from .checkpoint import CheckpointInfo, example_inputs
from .errors import ValidationError


def library_inputs(layout: str, inputs: tuple[np.ndarray, ...], seq: int, tokens: int | None = None
                   ) -> tuple[np.ndarray, ...]:
    """What a library of `layout` takes for padded example rows (ids, mask, type ids, positions):
    the rows themselves, or packed (sequences padded to `seq`, `tokens` packed rows)."""
    if layout == "packed":
        return pack_batch(*inputs[:3], seq=seq, tokens=tokens)
    return inputs


def library_diff(runner: LibraryRunner, wrapper: torch.nn.Module, shape: AnyBucket, vocab_size: int, seed: int,
                 layout: str = "padded") -> tuple[float, float]:
    """(largest |tvm - torch|, largest |tvm - torch| / |torch| of an output row) over one random
    batch of `shape` (ragged attention mask included), PyTorch running the padded rows. PyTorch
    runs wherever the wrapper's weights are (the GPU, for a CUDA artifact)."""
    inputs = example_inputs(shape.rows, shape.seq, vocab_size, seed=seed)
    device = next(wrapper.parameters()).device
    with torch.no_grad():
        expected = wrapper(*(x.to(device) for x in inputs)).float().cpu().numpy()
    library_args = library_inputs(layout, tuple(x.numpy() for x in inputs), shape.seq)
    actual = runner(*library_args)
    if expected.ndim == 3:  # token states: compared on the real tokens only, one row per token
        if layout == "packed":
            actual = per_sequence_rows(actual, library_args[PACKED_INPUT_NAMES.index("gather")])
        real = inputs[1].numpy().astype(bool)
        actual, expected = (actual[real] if actual.shape == expected.shape else actual), expected[real]
    if actual.shape != expected.shape:
        return float("inf"), float("inf")
    rows = np.linalg.norm(actual - expected, axis=1) / np.maximum(np.linalg.norm(expected, axis=1), 1e-12)
    return float(np.max(np.abs(actual - expected))), float(rows.max())


# What a user can do about a validation failure: a model whose activations are large and cancel (a
# planted test checkpoint's fp32 rounding reached 4e-3 of PyTorch's) loses more than 1e-4 to any
# change of summation order, PyTorch's own included
TOLERANCE_HINT = " (the compile config's `tolerance`)"


def checked_diff(name: str, runner: LibraryRunner, wrapper: torch.nn.Module, shape: AnyBucket, vocab_size: int,
                 seed: int, tolerance: float, layout: str = "padded", relative: bool = False) -> float:
    """The max abs diff of `library_diff`, or a ValidationError naming the library and shape when
    it (or, `relative`, the row-relative error: what int8 is held to) is over `tolerance`."""
    diff, relative_diff = library_diff(runner, wrapper, shape, vocab_size, seed, layout)
    if relative and not relative_diff <= tolerance:
        raise ValidationError(f"{name} at {shape.name}: max |tvm - torch| / |torch| of a row = {relative_diff:.3g} "
                              f"exceeds tolerance {tolerance:g}{TOLERANCE_HINT}")
    if not relative and not diff <= tolerance:
        raise ValidationError(f"{name} at {shape.name}: max |tvm - torch| = {diff:.3g} exceeds tolerance "
                              f"{tolerance:g}{TOLERANCE_HINT}")
    return diff


DRIFT_SENTENCES = [
    "A man is playing a guitar on stage.",
    "The new movie was surprisingly good.",
    "How do I reset my password?",
    "Stock markets fell sharply on Monday after the announcement.",
    "The cat sleeps on the warm windowsill.",
    "Compilers turn high-level programs into efficient machine code.",
    "It will rain tomorrow in the northern mountains.",
    "She ordered a coffee and a slice of lemon cake.",
]


def cosine_drift(dense: torch.nn.Module, pruned: torch.nn.Module, info: CheckpointInfo) -> float:
    """Mean cosine similarity of the pruned model's outputs to the dense model's on fixed sentences."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(info.tokenizer_file))
    tokenizer.enable_padding()
    tokenizer.enable_truncation(min(128, info.max_seq))
    encodings = tokenizer.encode_batch(DRIFT_SENTENCES)
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    args = (ids, mask, torch.zeros_like(ids), torch.arange(ids.shape[1]).expand_as(ids))
    with torch.no_grad():
        similarity = torch.nn.functional.cosine_similarity(dense(*args).float(), pruned(*args).float(), dim=-1)
    return float(similarity.mean())
