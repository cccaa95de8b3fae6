"""The attention kernel family for CPUs: softmax(Q K^T * scale + bias) V in one kernel per layer.

Unfused, a BERT layer's attention is a dozen kernels (gathers, transposes, two batch matmuls, the
scale and mask, the softmax) that write the [batch, heads, seq, seq] scores and every transposed
copy of Q, K and V to memory, each paying a parallel launch. Here one task per (sequence, head):

    L = 1 + the last key whose bias marks it real     (keys after it add exactly 0 to the softmax)
    Kt[d, j] = K[row(j), k_off + h * D + d]  for j < L (transposed once: keys become vector lanes)
    for each tile of `rows` queries i < L:
        s[i, j] = (Q[row(i)] * scale) . Kt[:, j] + bias[j]        register tile rows x lanes
        s[i, :] = exp(s[i, :] - max_j s[i, j]); sum_i = sum_j s[i, j]     vectorised rows
        out[row(i), h * D : (h + 1) * D] = (s[i, :L] @ V[row(:L)]) / sum_i   register tile rows x D

Q, K and V are read straight from the linear layers' outputs (the Q/K/V concatenation included:
one source tensor, three column offsets), through `row`: a token's row in the packed layout's
[tokens, hidden] (the `gather` input) or `b * seq + i` in the padded layout's [batch * seq, hidden].
Scores live in a per-task buffer of `rows` x `max_seq` floats (16 KB at 8 x 512), so nothing of
size seq^2 reaches memory; with every row of a tile at hand, the softmax is the exact two-pass
one (online softmax over key tiles pays only when that buffer outgrows the caches, beyond the 512
positions of BERT-family models). Work scales with each sequence's own length, not the bound:
keys and queries past a sequence's last real token are skipped (padded layout: its padding rows
are written as zeros, which no output reads).

The packed layout's inputs (artifact/packed_batch.py) carry the contract this relies on: `gather`
and `scatter` are inverse maps on real tokens, so writing row gather[b, i] is the graph's
take(context, scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from .common import prescheduled
from .fast_math import fast_math

KERNEL_NAME = "fused_attention"
REAL_KEY_BIAS = -1e30  # an additive bias at or below this marks a padding key (float32 min)
NEG = -3.4028234663852886e38


@dataclass(frozen=True)
class AttentionShape:
    """What one attention kernel is written for.

    `batch`, `seq` and `rows` (the source tensors' row count) are ints or symbolic int64 vars;
    `max_seq` bounds a symbolic `seq` (the per-task buffers' size); `packed` selects the row map.
    """

    batch: object
    seq: object
    rows: object
    heads: int
    head_size: int
    max_seq: int
    scale: float
    packed: bool
    widths: tuple[int, int, int]  # columns of the Q, K and V source tensors
    offsets: tuple[int, int, int]  # where Q, K and V start in them


def query_rows(lanes: int, head_size: int) -> int:
    """Queries per register tile: the rows x head_size output tile (in vectors of `lanes`) must fit
    the register file beside its operands, 16 accumulators of 32 zmm (AVX-512), 12 of 16 ymm (AVX2)."""
    budget = 16 if lanes >= 16 else 12
    return max(1, min(8, budget // max(1, head_size // lanes)))


def supports(head_size: int, lanes: int) -> bool:
    return head_size % lanes == 0


def write_attention(shape: AttentionShape, lanes: int) -> tirx.PrimFunc:
    """The kernel's PrimFunc, written already scheduled (parallel, vectorised, register-tiled)."""
    i64 = lambda value: tirx.IntImm("int64", value)  # noqa: E731
    H, D = i64(shape.heads), i64(shape.head_size)
    S_MAX = i64(-(-shape.max_seq // lanes) * lanes)  # keys are padded to whole vectors
    LANES, ROWS = i64(lanes), i64(query_rows(lanes, shape.head_size))
    (NQ, NK, NV), (QO, KO, VO) = (i64(w) for w in shape.widths), (i64(o) for o in shape.offsets)
    B, S, R = (i64(x) if isinstance(x, int) else x for x in (shape.batch, shape.seq, shape.rows))
    R_OUT = R if shape.packed else B * S
    SCALE = tirx.const(shape.scale, "float32")
    packed = shape.packed
    zero, neg, real_key = (tirx.const(v, "float32") for v in (0.0, NEG, REAL_KEY_BIAS))

    def row_of(gather, b, i, rows):
        """The source (or output) row of sequence b's token i: packed, its gathered row (clamped,
        as the graph's take(mode="clip")); padded, b * seq + i."""
        return T.max(T.min(gather[b, i], rows - i64(1)), i64(0)) if packed else b * S + i

    @T.prim_func(s_tir=True)
    def attention(q_src: T.Buffer((R, NQ), "float32"), k_src: T.Buffer((R, NK), "float32"),
                  v_src: T.Buffer((R, NV), "float32"), bias: T.Buffer((B, i64(1), i64(1), S), "float32"),
                  gather: T.Buffer((B, S), "int64"), out: T.Buffer((R_OUT, H * D), "float32")):
        T.func_attr({"tirx.noalias": True})
        for bh in T.parallel(B * H):
            b = bh // H
            h = bh % H
            length = T.alloc_buffer((i64(1),), "int64", scope="local")
            length[0] = i64(0)
            for j in T.serial(S):
                if bias[b, i64(0), i64(0), j] > real_key:
                    length[0] = j + i64(1)
            keys_t = T.alloc_buffer((D, S_MAX), "float32")
            for j, d in T.grid(length[0], D):
                keys_t[d, j] = k_src[row_of(gather, b, j, R), KO + h * D + d]
            for j, d in T.grid((length[0] + LANES - i64(1)) // LANES * LANES - length[0], D):
                keys_t[d, length[0] + j] = zero
            for tile in T.serial((length[0] + ROWS - i64(1)) // ROWS):
                q_tile = T.alloc_buffer((ROWS, D), "float32")
                scores = T.alloc_buffer((ROWS, S_MAX), "float32")
                totals = T.alloc_buffer((ROWS,), "float32")
                for r, d in T.grid(ROWS, D):
                    i = T.min(tile * ROWS + r, length[0] - i64(1))
                    q_tile[r, d] = q_src[row_of(gather, b, i, R), QO + h * D + d] * SCALE
                for block in T.serial((length[0] + LANES - i64(1)) // LANES):
                    acc = T.alloc_buffer((ROWS, LANES), "float32", scope="local")
                    for r in T.unroll(ROWS):
                        for lane in T.vectorized(LANES):
                            acc[r, lane] = zero
                    for d in T.serial(D):
                        for r in T.unroll(ROWS):
                            for lane in T.vectorized(LANES):
                                acc[r, lane] = acc[r, lane] + q_tile[r, d] * keys_t[d, block * LANES + lane]
                    for r in T.unroll(ROWS):
                        for lane in T.vectorized(LANES):
                            scores[r, block * LANES + lane] = T.if_then_else(
                                block * LANES + lane < length[0],
                                acc[r, lane] + bias[b, i64(0), i64(0), T.min(block * LANES + lane, S - i64(1))], neg)
                for r in T.serial(ROWS):
                    partial = T.alloc_buffer((LANES,), "float32", scope="local")
                    for lane in T.vectorized(LANES):
                        partial[lane] = neg
                    for block in T.serial((length[0] + LANES - i64(1)) // LANES):
                        for lane in T.vectorized(LANES):
                            partial[lane] = T.max(partial[lane], scores[r, block * LANES + lane])
                    top = T.alloc_buffer((i64(1),), "float32", scope="local")
                    top[0] = neg
                    for lane in T.serial(LANES):
                        top[0] = T.max(top[0], partial[lane])
                    for lane in T.vectorized(LANES):
                        partial[lane] = zero
                    for block in T.serial((length[0] + LANES - i64(1)) // LANES):
                        for lane in T.vectorized(LANES):
                            scores[r, block * LANES + lane] = T.if_then_else(
                                block * LANES + lane < length[0], T.exp(scores[r, block * LANES + lane] - top[0]), zero)
                            partial[lane] = partial[lane] + scores[r, block * LANES + lane]
                    totals[r] = zero
                    for lane in T.serial(LANES):
                        totals[r] = totals[r] + partial[lane]
                context = T.alloc_buffer((ROWS, D), "float32", scope="local")
                for r in T.unroll(ROWS):
                    for d in T.vectorized(D):
                        context[r, d] = zero
                for j in T.serial(length[0]):
                    for r in T.unroll(ROWS):
                        for d in T.vectorized(D):
                            context[r, d] = context[r, d] + scores[r, j] * v_src[row_of(gather, b, j, R), VO + h * D + d]
                for r in T.serial(ROWS):
                    if tile * ROWS + r < length[0]:
                        i = tile * ROWS + r
                        for d in T.vectorized(D):
                            out[row_of(gather, b, i, R_OUT), h * D + d] = context[r, d] / totals[r]
            if not packed:
                for i, d in T.grid(S - length[0], D):
                    out[b * S + length[0] + i, h * D + d] = zero

    func = attention if packed else _without_param(attention, "gather")  # the padded row map needs none
    return prescheduled(fast_math(func))


def _without_param(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """`func` without the buffer parameter `name`, which its body does not read."""
    return tirx.PrimFunc([p for p in func.params if p.name != name], func.body, func.ret_type, func.attrs)
