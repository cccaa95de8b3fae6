"""The packed layout's inputs: a padded batch of token rows, concatenated without its padding.

A packed library runs every linear layer, layer norm and GELU on `[tokens, hidden]`, the real
tokens of all sequences one after another, and gathers them per sequence only for attention and
pooling. Its inputs, built here from the padded `[batch, seq]` rows the tokenizer gives:

- input_ids, token_type_ids, position_ids `[tokens]`: the real tokens, positions restarting at 0
  for each sequence;
- gather `[batch, seq]`: where each sequence's j-th token sits in the packed rows (0 past its
  end, masked out);
- attention_mask `[batch, seq]`: the batch's own mask values on real tokens (1; a ColBERT query's
  expansion tokens 2: computed, not attended to), 0 past each sequence's end;
- scatter `[tokens]`: each packed token's position in the `[batch * seq]` attention output.

On real tokens `gather` and `scatter` are inverse maps (scatter[gather[b, i]] = b * seq + i); the
fused attention kernel (compile/kernels/attention.py) writes each sequence's rows through `gather`
on that promise.
"""

from __future__ import annotations

import math

import numpy as np

PACKED_INPUT_NAMES = ("input_ids", "token_type_ids", "position_ids", "gather", "attention_mask", "scatter")
# Bytes a runtime's tensor must start on to share a host array (TVM's DLPack import checks it)
ALIGNMENT = 64
RIGHT_PADDED = "packing needs right-padded rows: each attention mask must be ones, then zeros"


def aligned_int64(*shapes: tuple[int, ...]) -> list[np.ndarray]:
    """Zeroed int64 arrays of `shapes` carved from one allocation, each starting on an ALIGNMENT
    boundary, so a runtime can take them as they are (one allocation, no copies, per call)."""
    per_line = ALIGNMENT // 8
    sizes = [math.prod(shape) for shape in shapes]
    spans = [-(-size // per_line) * per_line for size in sizes]  # each rounded up to whole lines
    block = np.zeros(sum(spans) + per_line, dtype=np.int64)
    start = -block.__array_interface__["data"][0] % ALIGNMENT // 8
    arrays = []
    for shape, size, span in zip(shapes, sizes, spans):
        arrays.append(block[start:start + size].reshape(shape))
        start += span
    return arrays


def pack_batch(input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray | None = None,
               seq: int | None = None, tokens: int | None = None) -> tuple[np.ndarray, ...]:
    """The six packed inputs of a right-padded batch (each row's mask is ones, then zeros).

    `seq` pads the per-sequence arrays to a packed bucket's bound (default: the batch's own
    width); `tokens` appends pad tokens up to that many packed rows (default: none), which the
    model computes and drops, as a padded library would.
    """
    input_ids = np.asarray(input_ids)
    values = np.asarray(attention_mask)
    mask = values.astype(bool)
    batch, width = input_ids.shape
    seq = width if seq is None else seq
    if batch == 1:
        return _pack_one(input_ids, values, token_type_ids, seq, tokens)
    lengths = mask.sum(axis=1)
    if not (mask == (np.arange(width)[None, :] < lengths[:, None])).all():
        raise ValueError(RIGHT_PADDED)
    real = int(lengths.sum())
    packed_ids, packed_types, positions, gather, sequence_mask, scatter = _packed_arrays(
        int(lengths.max(initial=0)), real, batch, seq, tokens)
    rows, columns = np.nonzero(mask)  # row-major: exactly the packed order
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    packed_ids[:real] = input_ids[rows, columns]
    if token_type_ids is not None:
        packed_types[:real] = np.asarray(token_type_ids)[rows, columns]
    positions[:real] = columns
    gather[rows, columns] = starts[rows] + columns
    sequence_mask[rows, columns] = values[rows, columns]
    scatter[:real] = rows * seq + columns
    return packed_ids, packed_types, positions, gather, sequence_mask, scatter


def _packed_arrays(longest: int, real: int, batch: int, seq: int, tokens: int | None) -> list[np.ndarray]:
    """The six zeroed packed arrays of `batch` sequences of `real` tokens in all (`tokens` rows, default
    `real`), or why they do not fit (the longest past the bound `seq`, or more tokens than rows)."""
    if longest > seq:
        raise ValueError(f"a sequence of {longest} tokens does not fit a packed bucket of {seq}")
    tokens = real if tokens is None else tokens
    if tokens < real:
        raise ValueError(f"{real} tokens do not fit {tokens} packed rows")
    return aligned_int64((tokens,), (tokens,), (tokens,), (batch, seq), (batch, seq), (tokens,))


def per_sequence_rows(token_rows: np.ndarray, gather: np.ndarray) -> np.ndarray:
    """A packed library's per-token output `[tokens, dim]` as `[batch, seq, dim]` through `gather`
    (rows past a sequence's end repeat packed row 0: whatever reads them masks them out)."""
    return token_rows[gather]


def _pack_one(input_ids: np.ndarray, values: np.ndarray, token_type_ids: np.ndarray | None, seq: int,
              tokens: int | None) -> tuple[np.ndarray, ...]:
    """pack_batch of one sequence (a query: the most common request), the same arrays in a third
    of the numpy calls, each of which costs microseconds right after a model call has filled the
    caches with weights."""
    mask = values.astype(bool)
    length = int(mask.sum())
    if not mask[0, :length].all():
        raise ValueError(RIGHT_PADDED)
    packed_ids, packed_types, positions, gather, sequence_mask, scatter = _packed_arrays(length, length, 1, seq, tokens)
    packed_ids[:length] = input_ids[0, :length]
    if token_type_ids is not None:
        packed_types[:length] = np.asarray(token_type_ids)[0, :length]
    positions[:length] = np.arange(length)
    gather[0, :length] = scatter[:length] = positions[:length]
    sequence_mask[0, :length] = values[0, :length]
    return packed_ids, packed_types, positions, gather, sequence_mask, scatter
