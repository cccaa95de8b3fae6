"""The attention kernel family for CPUs: softmax(Q K^T * scale + bias) V in one kernel per layer.

Unfused, a BERT layer's attention is a dozen kernels (gathers, transposes, two batch matmuls, the
scale and mask, the softmax) that write the [batch, heads, seq, seq] scores and every transposed
copy of Q, K and V to memory, each paying a parallel launch. Here one task per (sequence, head),
with queries in the vector lanes (a tile of them: two vectors with AVX2 or AVX-512, else one):

    L = 1 + the last key whose bias marks it real     (keys after it add exactly 0 to the softmax)
    Kh[j, d] = K[row(j), k_off + h * D + d]; Vh[j, d] likewise     (j < L, zeros to a whole key tile)
    for each tile of queries i < L:
        Qt[d, i] = Q[row(i), q_off + h * D + d] * scale * log2(e)   (a [D, tile] transposed copy)
        sT[j, i] = sum_d Kh[j, d] * Qt[d, i] + bias[j] * log2(e)   a few keys x the tile's queries
        sT[j, i] = 2^(sT[j, i] - max_j sT[j, i]); sum_i = sum_j sT[j, i]   per query, lane by lane
        out[row(i), h * D + d] = sum_j sT[j, i] * Vh[j, d] / sum_i  QP queries x 2 vectors of dims

The second product turns the layout around: a few queries' scores are broadcast against whole
vectors of Vh's dims, so each output row is written as D / lanes vector stores, not lane by lane
as a transposed scalar write of every query's row. Keys are broadcast
from Kh, values read from Vh: this head's columns of the sequence's K and V rows, staged once per
task (not transposed). Every query tile's products read them at fixed strides from one pointer
per key tile, where reading the source rows cost a clamped row gather per key and tile (2-3% of
the kernel's time in a 512-token call). With queries in the lanes the
softmax over keys is plain vector max / exp / add down the keys, no horizontal reductions. The
scores are in log2 units, so the softmax's exp is 2^x (fast_math.exp2_of_nonpositive), whose
reduction is two adds where exp's takes two multiply-adds on the ports the products need: the
fp32 kernel took 0.93-0.96x the time in MiniLM calls at 128 and 512 tokens (docs/experiments/attention-exp2.md).

Q, K and V are read from the linear layers' outputs (the Q/K/V concatenation included: one source
tensor, three column offsets), through `row`: a token's row in the packed layout's [tokens,
hidden] (the `gather` input) or `b * seq + i` in the padded layout's [batch * seq, hidden].
Scores live in a per-task buffer of `max_seq` x tile floats (64 KB at 512 x 32; Kh and Vh are
64 KB each at 512 x 32), so nothing of size seq^2 reaches memory; with every key of a tile at
hand the softmax is the exact two-pass one (online softmax over key tiles pays only when that
buffer outgrows the caches, beyond the 512 positions of BERT-family models). Work scales with
each sequence's own length, not the bound: keys and queries past a sequence's last real token
are skipped (padded layout: its padding rows are written as zeros, which no output reads).

A sliding-window layer (`AttentionShape.window`: ModernBERT's local layers, where a query sees the keys at
most `window` positions away) runs each tile of queries over the keys its window reaches only, from the
key tile at or below `tile start - window` to the one past `tile end + window` (each query's own window
masked within them), so its products cost `seq x (2 window + tile)`, linear in the sequence's length, and
touch a window's rows of the scores buffer; the window is within a sequence's own keys by construction,
packed batches included. Its products are fp32 or bf16 (the micro-kernels run on the window's keys from a
staged tile on, each query's window masked between the scores and the softmax), bf16 also in the
libraries whose other layers run AMX or int8 products, where the CPU has AVX512_BF16 (`_window_products`).

In bf16 libraries (and int8 ones, where timed faster) the two products and the softmax between
them run on attention_bf16.py's micro-kernels instead (which also round each tile's scaled queries
straight from their rows into the dim pairs the products read), or with the products on AMX tiles
(attention_amx.py, keys and values then staged to whole 32-key tiles), with the same staging,
tiles and row maps around them. int8 libraries may run them in int8 instead (attention_int8.py, ymm or zmm:
the staged keys and values, each tile's queries and its probabilities quantized, 16 queries a
tile, keys staged to whole quads). In every library the threads claim the (sequence, head) tasks as
they come free (launch.claim_iterations): a mixed batch's long sequences do not land on one thread.

The code follows that split: one skeleton (`_write_attention`: each task's length, its keys and values
staged, the padding rows) and one object per arithmetic (`Fp32Products`, `Bf16Products`, `AmxProducts`,
`Int8Products`) that stages the products' operands and writes a tile of queries' rows.

The packed layout's inputs (artifact/packed_batch.py) carry the contract this relies on: `gather`
and `scatter` are inverse maps on real tokens, so writing row gather[b, i] is the graph's
take(context, scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from tvm import tirx
from tvm.script import tirx as T

from . import attention_amx, attention_bf16, attention_int8, script
from .common import prescheduled, without_param
from .fast_math import LOG2E, exp2_of_nonpositive, fast_math
from .launch import MIN_PARALLEL_WORK, claim_iterations

if TYPE_CHECKING:  # the capabilities ask the kernel modules what they support: a type only here
    from ..capabilities import KernelConfig

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
    # a score bias added before the mask, by each sequence's own query and key positions i and j: "" none;
    # "relative": a [table_rows, heads] table read at [(j - i) mod table_rows, h] (MPNet's relative positions,
    # computed once per call in the graph: 2 x seq rows, not seq^2); "shared": [1, heads, seq, seq], read by every
    # sequence at [0, h, i, j]; "batched": [batch, heads, seq, seq], one per sequence
    score_bias: str = ""
    table_rows: object = 0  # a "relative" table's rows (at least 2 x seq - 1): an int or a symbolic var
    window: int | None = None  # sliding-window attention: keys at most this far from the query; None: all keys


# Steps unrolled into one iteration of the fp32 products' loops: over head dims for the scores (a head is
# lanes x n dims), over keys for the context (then one more step where the length is odd). x86-64-v3
# MiniLM calls at 128 and 512 tokens, paired: the attention kernel took 0.97-1.00x the time with the
# scores' loop unrolled, then 0.96-0.97x of that with the context's too; by 4 keys, no faster (1.00-1.01x)
DIMS_UNROLLED, KEYS_UNROLLED = 4, 2
KEYS = 8  # keys per register tile of scores in the bf16 and AMX products (and their staging)


def _score_tile(lanes: int) -> tuple[int, int]:
    """(queries, keys) of the fp32 scores' register tile, queries in the lanes: two vectors of queries,
    each key's broadcast feeding both, so that a tile reads fewer operands per FMA. With 16 ymm, 2 x 6
    keys: 12 accumulators, 8 loads per 12 FMAs. With 32 zmm, 2 x 12 keys: 24 accumulators, 14 loads per
    24 FMAs. One vector x 8 keys (8 accumulators) took 9 loads per 8 FMAs: against it the attention
    kernel takes 0.93-0.95x the time at x86-64-v3 and 0.84-0.87x at x86-64-v4, at 128 and 512 tokens
    (docs/experiments/attention-score-tile.md). The softmax x V product has its own passes (`_context_passes`)."""
    return (2 * lanes, 6) if lanes == 8 else (2 * lanes, 12) if lanes == 16 else (lanes, KEYS)


def supports(head_size: int, lanes: int) -> bool:
    return head_size % lanes == 0


def _context_passes(head_size: int, lanes: int, tile: int) -> tuple[int, int, int, int]:
    """(vectors of head dims, queries, passes with that many, passes with one fewer) of the softmax x V
    product over a tile: a pass accumulates up to 12 vectors with 16 registers (AVX2, SSE, NEON), 24
    with AVX-512's 32, the rest holding its value vectors and a score's broadcast. Two vectors of dims
    a pass (where they divide the head) leave room for 6 (12) queries, and the tile's queries are shared
    out as evenly as that allows (16 as 6 + 5 + 5: a pass of 8 accumulators ran at 0.85x the rate of one
    of 12). Against passes of whole head rows (1-2 queries, 8 ymm), the attention kernel takes 0.94-0.98x
    the time at x86-64-v3 on MiniLM's 32-wide heads, 0.76-0.87x on bert-base's 64-wide ones, and
    0.98-1.00x at x86-64-v4, at 128 and 512 tokens (docs/experiments/context-passes.md)."""
    vectors = head_size // lanes
    per_pass = next(n for n in (2, 3, 1) if vectors % n == 0)
    passes = -(-tile // ((24 if lanes >= 16 else 12) // per_pass))
    queries = -(-tile // passes)
    smaller = passes * queries - tile
    return per_pass, queries, passes - smaller, smaller


def write_attention(shape: AttentionShape, kernels: KernelConfig) -> tirx.PrimFunc:
    """The kernel's PrimFunc, written already scheduled (parallel, vectorised, register-tiled), at
    `kernels`' lanes with its products in `kernels.products`: "bf16" on attention_bf16's micro-kernels,
    "amx" on attention_amx's tiles, "int8" on attention_int8's, "fp32" in TIR loops (`ARITHMETIC`). Products
    the CPU has no kernel for at this head size (`Capabilities.attention_products`) are refused.

    Parsing the script takes seconds (each use of a macro parses it again), and a compile asks for
    the same kernel for every library it builds and for its pass report, so each kernel is written
    once per process where its sizes are ints or vars: vars are told apart by name and type (a
    PrimFunc's vars are its own)."""
    lanes = kernels.capabilities.lanes
    products = kernels.products if shape.window is None else _window_products(kernels, shape.head_size)
    if products != "fp32" and products not in kernels.capabilities.attention_products(shape.head_size):
        raise ValueError(f"the fused attention kernel has no {products} products for {shape.head_size}-wide heads "
                         f"at {lanes} lanes")
    sizes = (shape.batch, shape.seq, shape.rows, shape.table_rows)
    if not all(isinstance(x, (int, tirx.Var)) for x in sizes):  # an expression of a var: written as given
        return _write_attention(shape, lanes, products)
    named = [(x.name, str(x.ty)) if isinstance(x, tirx.Var) else x for x in sizes]
    return _written(replace(shape, batch=named[0], seq=named[1], rows=named[2], table_rows=named[3]), lanes, products)


def _window_products(kernels: KernelConfig, head_size: int) -> str:
    """A sliding window's products: the AMX and int8 kernels take every key of a tile from key 0, so their
    libraries' windowed layers run on the AVX512_BF16 micro-kernels where the CPU has them, else in fp32."""
    if kernels.products == "fp32" or "bf16" not in kernels.capabilities.attention_products(head_size):
        return "fp32"
    return "bf16"


@lru_cache(maxsize=64)
def _written(shape: AttentionShape, lanes: int, products: str) -> tirx.PrimFunc:
    """`_write_attention` of a shape whose symbolic sizes are (name, dtype) pairs."""
    batch, seq, rows, table_rows = (tirx.Var(*x) if isinstance(x, tuple) else x
                                    for x in (shape.batch, shape.seq, shape.rows, shape.table_rows))
    return _write_attention(replace(shape, batch=batch, seq=seq, rows=rows, table_rows=table_rows), lanes, products)


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


def _start(buffer, access):
    """The whole of `buffer` for a C routine that reads ("r") or writes ("w") it. The bf16 and int8
    operands travel as pairs or quads in 32-bit words typed float32, so TVM's storage planner may share
    their memory with the fp32 staging buffers (it cannot give a uint16 buffer's access pointer the memory
    of a float32 one)."""
    return buffer.access_ptr(access)


def _call(symbol, *args):
    return T.call_extern("int32", symbol, *args)  # each C routine returns 0


@dataclass(frozen=True)
class _Kernel:
    """What the skeleton and the arithmetic of one kernel share: its sizes as int64 TIR constants (or the
    shape's vars) and the row maps. TQ queries a tile; keys staged to a multiple of STAGE, up to S_MAX."""

    shape: AttentionShape
    H: tirx.PrimExpr
    D: tirx.PrimExpr
    V: tirx.PrimExpr
    TQ: tirx.PrimExpr
    STAGE: tirx.PrimExpr
    S_MAX: tirx.PrimExpr
    B: tirx.PrimExpr
    S: tirx.PrimExpr
    R: tirx.PrimExpr
    R_OUT: tirx.PrimExpr  # rows of the output: the source's (packed), batch x seq (padded)
    NQ: tirx.PrimExpr
    QO: tirx.PrimExpr
    SCALE: tirx.PrimExpr
    SB: tuple  # the score bias's shape

    @classmethod
    def of(cls, shape: AttentionShape, lanes: int, queries: int, stage: int) -> "_Kernel":
        B, S, R = (_i64(x) if isinstance(x, int) else x for x in (shape.batch, shape.seq, shape.rows))
        return cls(shape, _i64(shape.heads), _i64(shape.head_size), _i64(lanes), _i64(queries), _i64(stage),
                   _i64(-(-shape.max_seq // stage) * stage), B, S, R, R if shape.packed else B * S,
                   _i64(shape.widths[0]), _i64(shape.offsets[0]), tirx.const(shape.scale, "float32"),
                   _score_bias_shape(shape, B, S))

    def row_of(self, gather, b, i, rows):
        """The source (or output) row of sequence b's token i: packed, its gathered row (clamped,
        as the graph's take(mode="clip")); padded, b * seq + i."""
        return T.max(T.min(gather[b, i], rows - _i64(1)), _i64(0)) if self.shape.packed else b * self.S + i

    def score_bias_at(self, score_bias, b, h, i, j):
        """Sequence b's score bias of head h, query i and key j."""
        kind = self.shape.score_bias
        if kind == "relative":  # (j - i) mod rows, |j - i| < seq <= rows
            return score_bias[T.if_then_else(j >= i, j - i, j - i + score_bias.shape[0]), h]
        return score_bias[b if kind == "batched" else _i64(0), h, i, j]

    def stage_score_bias(self, factor: float):
        """A macro: tile_bias[j, lane] = the score bias of the tile's query `lane` (the last real one repeated
        past the sequence's end) and key j, times `factor`, for the real keys: transposed, so that the
        products add a key's row of queries as one vector, as they add the mask."""
        TQ, FACTOR, score_bias_at, staged = self.TQ, tirx.const(factor, "float32"), self.score_bias_at, self.staged

        @T.macro
        def stage_score_bias(tile_bias, score_bias, b, h, tile, length):
            for lane in T.serial(TQ):
                for j in T.serial(staged(length)):  # zeros past the real keys, up to a whole tile
                    tile_bias[j, lane] = T.if_then_else(j < length[0], score_bias_at(
                        score_bias, b, h, T.min(tile * TQ + lane, length[0] - _i64(1)),
                        T.min(j, length[0] - _i64(1))) * FACTOR, tirx.const(0.0, "float32"))

        return stage_score_bias

    def staged(self, length):
        """How many keys are staged for a sequence of `length` real keys (zeros past them)."""
        return (length[0] + self.STAGE - _i64(1)) // self.STAGE * self.STAGE

    def key_span(self, tile, length):
        """(first key, end) of the keys a tile of queries reads: every real one, or (sliding window) those in
        reach of its queries, from a whole staged tile of keys on (the end a whole one too, or the last real key)."""
        if self.shape.window is None:
            return _i64(0), length[0]
        window, stage = _i64(self.shape.window), self.STAGE
        first = T.max(tile * self.TQ - window, _i64(0)) // stage * stage
        return first, T.min((tile * self.TQ + self.TQ + window + stage - _i64(1)) // stage * stage, self.staged(length))

    def windowed(self, score, i, j, length):
        """The score of query i and key j, masked where j is out of i's window (queries past the end
        count as the last one)."""
        if self.shape.window is None:
            return score
        reach = T.abs(T.min(i, length[0] - _i64(1)) - j)
        return T.if_then_else(reach <= _i64(self.shape.window), score, tirx.const(NEG, "float32"))

    def query_tiles(self, length):
        """The loop over the tiles of queries of a sequence of `length` tokens."""
        return T.serial((length[0] + self.TQ - _i64(1)) // self.TQ)

    def query_offsets(self):
        """A macro: where each query of the tile starts in q_src (the last real one repeated past the
        sequence's end), for the C routines that round or quantize a tile's queries straight from their rows."""
        TQ, NQ, QO, D, R, row_of = self.TQ, self.NQ, self.QO, self.D, self.R, self.row_of

        @T.macro
        def query_offsets(query_rows, gather, b, h, tile, length):
            for lane in T.serial(TQ):
                i = T.min(tile * TQ + lane, length[0] - _i64(1))
                query_rows[lane] = row_of(gather, b, i, R) * NQ + QO + h * D

        return query_offsets


class Fp32Products:
    """The products in fp32 in TIR loops, queries in the vector lanes: a register tile of keys x queries for
    the scores (`_score_tile`), the softmax down the keys, passes of queries x dims for the context."""

    name = "fp32"

    def __init__(self, lanes: int):
        self.queries, self.keys = _score_tile(lanes)
        self.stage = self.keys  # keys are staged (zero) to whole register tiles

    def products(self, k: _Kernel):
        """A macro: the tile loop over `keys` and `values` as staged, with the keys' mask."""
        S_MAX, TQ, D, R, QO, staged = k.S_MAX, k.TQ, k.D, k.R, k.QO, k.staged
        LOG2_SCALE, LOG2_E = tirx.const(k.shape.scale * LOG2E, "float32"), tirx.const(LOG2E, "float32")
        neg, row_of, query_tiles = tirx.const(NEG, "float32"), k.row_of, k.query_tiles
        tile_of, biased, stage_score_bias = self._tile(k), bool(k.shape.score_bias), k.stage_score_bias(LOG2E)

        @T.macro
        def products(q_src, bias, score_bias, gather, out, keys, values, b, h, length):
            # the mask of the keys, -inf past the last key (a whole tile staged)
            key_bias = T.alloc_buffer((S_MAX,), "float32")
            for j in T.serial(staged(length)):
                key_bias[j] = T.if_then_else(j < length[0], T.max(
                    bias[b, _i64(0), _i64(0), T.min(j, length[0] - _i64(1))] * LOG2_E, neg), neg)
            scores = T.alloc_buffer((S_MAX, TQ), "float32")
            tile_bias = T.alloc_buffer((S_MAX if biased else _i64(1), TQ), "float32")  # in log2 units
            for tile in query_tiles(length):
                queries = T.alloc_buffer((D, TQ), "float32")
                for d, lane in T.grid(D, TQ):
                    i = T.min(tile * TQ + lane, length[0] - _i64(1))
                    queries[d, lane] = q_src[row_of(gather, b, i, R), QO + h * D + d] * LOG2_SCALE
                if biased:
                    stage_score_bias(tile_bias, score_bias, b, h, tile, length)
                tile_of(keys, values, queries, scores, key_bias, tile_bias, out, gather, b, h, tile, length)

        return products

    def _tile(self, k: _Kernel):
        """A macro: one tile of queries in fp32: scores, softmax, and the weighted sum of values."""
        TQ, V = k.TQ, k.V
        QV = TQ // V  # vectors of queries a tile
        zero, neg = tirx.const(0.0, "float32"), tirx.const(NEG, "float32")
        scores_of, context_of = self._scores(k), self._context(k)

        key_span = k.key_span

        @T.macro
        def fp32_tile(keys, values, queries, scores, key_bias, tile_bias, out, gather, b, h, tile, length):
            first, end = key_span(tile, length)
            top = T.alloc_buffer((TQ,), "float32", scope="local")
            total = T.alloc_buffer((TQ,), "float32", scope="local")
            for qv in T.unroll(QV):
                for lane in T.vectorized(V):
                    top[qv * V + lane] = neg
                    total[qv * V + lane] = zero
            scores_of(keys, queries, scores, top, key_bias, tile_bias, tile, length, first, end)
            for j in T.serial(first, end):
                for qv in T.unroll(QV):
                    for lane in T.vectorized(V):
                        scores[j, qv * V + lane] = exp2_of_nonpositive(scores[j, qv * V + lane] - top[qv * V + lane])
                        total[qv * V + lane] = total[qv * V + lane] + scores[j, qv * V + lane]
            inverse = T.alloc_buffer((TQ,), "float32", scope="local")
            for qv in T.unroll(QV):
                for lane in T.vectorized(V):
                    inverse[qv * V + lane] = T.float32(1) / total[qv * V + lane]
            context_of(values, scores, inverse, out, gather, b, h, tile, length, first, end)

        return fp32_tile

    def _scores(self, k: _Kernel):
        """A macro: sT[j, i] = sum_d Kh[j, d] * Qt[d, i] + bias[j] (-inf past the last key: `key_bias` is
        staged so, and the write-back has no branch), KB keys x QV vectors of queries a tile, and top[i] =
        max_j sT[j, i] taken as they are written: in a pass of its own over the scores each max waited on the
        one before it (x86-64-v3 MiniLM calls at 512 tokens: 0.99x the time)."""
        TQ, V, D, KB, DU = k.TQ, k.V, k.D, _i64(self.keys), _i64(DIMS_UNROLLED)
        QV, zero, windowed = TQ // V, tirx.const(0.0, "float32"), k.windowed
        biased = bool(k.shape.score_bias)

        @T.macro
        def fp32_scores(keys, queries, scores, top, key_bias, tile_bias, tile, length, first, end):
            for block in T.serial(first // KB, (end + KB - _i64(1)) // KB):
                acc = T.alloc_buffer((KB, TQ), "float32", scope="local")
                for key, qv in T.grid(KB, QV):
                    for lane in T.vectorized(V):
                        acc[key, qv * V + lane] = zero
                for d_steps in T.serial(D // DU):
                    for d_step in T.unroll(DU):
                        for key in T.unroll(KB):
                            for qv in T.unroll(QV):
                                for lane in T.vectorized(V):
                                    d = d_steps * DU + d_step
                                    acc[key, qv * V + lane] = (acc[key, qv * V + lane]
                                                               + keys[block * KB + key, d] * queries[d, qv * V + lane])
                for key in T.unroll(KB):
                    for qv in T.unroll(QV):
                        for lane in T.vectorized(V):
                            if biased:  # the queries' own score bias, staged as the tile's
                                scores[block * KB + key, qv * V + lane] = windowed(
                                    acc[key, qv * V + lane] + key_bias[block * KB + key]
                                    + tile_bias[block * KB + key, qv * V + lane], tile * TQ + qv * V + lane,
                                    block * KB + key, length)
                            else:
                                scores[block * KB + key, qv * V + lane] = windowed(
                                    acc[key, qv * V + lane] + key_bias[block * KB + key], tile * TQ + qv * V + lane,
                                    block * KB + key, length)
                            top[qv * V + lane] = T.max(top[qv * V + lane], scores[block * KB + key, qv * V + lane])

        return fp32_scores

    def _context(self, k: _Kernel):
        """A macro: the tile's head rows, out[row(i), h * D + d] = sum_j sT[j, i] * Vh[j, d] / sum_i, in passes
        of DP vectors of dims x QP queries, or QP - 1 (`_context_passes`): the scores broadcast, the values in
        vectors."""
        TQ, V, D, R_OUT, KU, row_of = k.TQ, k.V, k.D, k.R_OUT, _i64(KEYS_UNROLLED), k.row_of
        DP, QP, LARGER, SMALLER = (_i64(x) for x in _context_passes(k.shape.head_size, int(V), self.queries))
        zero = tirx.const(0.0, "float32")

        @T.macro
        def context_step(context, values, scores, j, first, dims, queries):
            """Key j's values weighted by its scores, added to the pass's `queries` x DP vectors."""
            for q in T.unroll(queries):
                for dv in T.unroll(DP):
                    for lane in T.vectorized(V):
                        context[q, dv * V + lane] = context[q, dv * V + lane] + (
                            scores[j, first + q] * values[j, dims + dv * V + lane])

        @T.macro
        def context_pass(values, scores, inverse, out, gather, b, h, tile, length, start, end, dims, queries, first):
            context = T.alloc_buffer((queries, DP * V), "float32", scope="local")
            for q, dv in T.grid(queries, DP):
                for lane in T.vectorized(V):
                    context[q, dv * V + lane] = zero
            for j_steps in T.serial((end - start) // KU):
                for j_step in T.unroll(KU):
                    context_step(context, values, scores, start + j_steps * KU + j_step, first, dims, queries)
            for j in T.serial(start + (end - start) // KU * KU, end):
                context_step(context, values, scores, j, first, dims, queries)
            for q in T.serial(queries):
                i = tile * TQ + first + q
                if i < length[0]:
                    for dv in T.unroll(DP):
                        for lane in T.vectorized(V):
                            out[row_of(gather, b, i, R_OUT), h * D + dims + dv * V + lane] = (
                                context[q, dv * V + lane] * inverse[first + q])

        @T.macro
        def fp32_context(values, scores, inverse, out, gather, b, h, tile, length, start, end):
            for part in T.serial(D // (DP * V)):
                for group in T.serial(LARGER):
                    context_pass(values, scores, inverse, out, gather, b, h, tile, length, start, end,
                                 part * DP * V, QP, group * QP)
                for group in T.serial(SMALLER):
                    context_pass(values, scores, inverse, out, gather, b, h, tile, length, start, end,
                                 part * DP * V, QP - _i64(1), LARGER * QP + group * (QP - _i64(1)))

        return fp32_context


class Bf16Products:
    """The products on attention_bf16's micro-kernels (AVX512_BF16), which also add the bias, take each
    query's largest score, and exp and round the probabilities: the keys rounded in dim pairs as staged,
    the values in key pairs, each tile's scaled queries rounded into dim pairs straight from their rows."""

    name = "bf16"
    symbols = attention_bf16  # the products' C routines: SCORES and CONTEXT per head size

    def __init__(self, lanes: int):
        self.queries = lanes  # a tile is one vector of queries
        self.stage = KEYS  # keys are staged (zero) to whole register tiles of the scores

    def products(self, k: _Kernel):
        """A macro: the operands rounded, then the tile loop."""
        S_MAX, TQ, D, V, SCALE = k.S_MAX, k.TQ, k.D, k.V, k.SCALE
        staged_keys, query_tiles, query_offsets = k.staged, k.query_tiles, k.query_offsets()
        stage_values, tile_of = self._stage_values(k), self._tile(k)
        biased, stage_score_bias = bool(k.shape.score_bias), k.stage_score_bias(1.0)

        @T.macro
        def products(q_src, bias, score_bias, gather, out, keys, values, b, h, length):
            scores = T.alloc_buffer((S_MAX, TQ), "float32")
            keys_b = T.alloc_buffer((S_MAX, D // _i64(2)), "float32")  # one bf16 pair per 32-bit word
            values_b = T.alloc_buffer((S_MAX // _i64(2), D), "float32")  # amx: [D, S_MAX] bf16, transposed
            queries_b = T.alloc_buffer((D // _i64(2), V), "float32")
            # where each query of a tile starts in q_src; "local", or the storage planner may give it the
            # memory of a float32 buffer, which an int64 pointer cannot address
            query_rows = T.alloc_buffer((V,), "int64", scope="local")
            probs_b = T.alloc_buffer((S_MAX // _i64(2), V), "float32")
            context_b = T.alloc_buffer((V, D), "float32")
            tile_bias = T.alloc_buffer((S_MAX if biased else _i64(1), V), "float32")
            staged = staged_keys(length)
            T.evaluate(_call(attention_bf16.ROUND, _start(keys_b, "w"), _start(keys, "r"), staged * D))
            stage_values(values_b, values, staged)
            for tile in query_tiles(length):  # the scaled queries rounded into dim pairs straight from their rows
                query_offsets(query_rows, gather, b, h, tile, length)
                T.evaluate(_call(attention_bf16.QUERY_PAIRS, _start(queries_b, "w"), q_src.access_ptr("r"),
                                 query_rows.access_ptr("r"), SCALE, D))
                if biased:
                    stage_score_bias(tile_bias, score_bias, b, h, tile, length)
                tile_of(keys_b, values_b, queries_b, scores, probs_b, context_b, bias, tile_bias, out, gather, b, h,
                        tile, length)

        return products

    def _stage_values(self, k: _Kernel):
        """A macro: the staged values rounded in key pairs, `[keys / 2, dims, 2]`."""
        D = k.D

        @T.macro
        def stage_values(values_b, values, staged):
            T.evaluate(_call(attention_bf16.PAIR_ROWS, _start(values_b, "w"), _start(values, "r"), staged // _i64(2),
                             D))

        return stage_values

    def _context(self, k: _Kernel):
        """A macro: context_b[queries, dims] = probs_b x values_b."""
        context_symbol, D = self.symbols.CONTEXT.format(head=k.shape.head_size), k.D

        @T.macro
        def context(context_b, probs_b, values_b, first, keys):  # values_b from key `first` on: [keys / 2, D] words
            T.evaluate(_call(context_symbol, _start(context_b, "w"), _start(probs_b, "r"),
                             values_b.access_ptr("r", offset=first // _i64(2) * D), (keys + _i64(1)) // _i64(2)))

        return context

    def _tile(self, k: _Kernel):
        """A macro: one tile of queries: scores, softmax and context in C, the normalised rows written. A sliding
        window's tile runs them on the keys in its reach (`_Kernel.key_span`), each query's window masked
        between the scores and the softmax (`_window_mask`)."""
        V, D, S, R_OUT, row_of, key_span = k.V, k.D, k.S, k.R_OUT, k.row_of, k.key_span
        scores_symbol = self.symbols.SCORES.format(head=k.shape.head_size)
        context, window_mask, tile_bias_of = self._context(k), self._window_mask(k), _tile_bias_pointer(k)

        @T.macro
        def bf16_tile(keys_b, values_b, queries_b, scores, probs_b, context_b, bias, tile_bias, out, gather, b, h, tile,
                      length):
            top = T.alloc_buffer((V,), "float32")
            total = T.alloc_buffer((V,), "float32")
            first, end = key_span(tile, length)
            keys = T.min(end, length[0]) - first  # the real ones: the bias is read for these only
            T.evaluate(_call(scores_symbol, _start(scores, "w"), _start(top, "w"),
                             keys_b.access_ptr("r", offset=first * (D // _i64(2))), _start(queries_b, "r"),
                             bias.access_ptr("r", offset=b * S + first), tile_bias_of(tile_bias, first), keys))
            window_mask(scores, top, tile, length, first, keys)
            T.evaluate(_call(attention_bf16.SOFTMAX_PAIRS, _start(probs_b, "w"), _start(total, "w"),
                             _start(scores, "r"), _start(top, "r"), keys))
            context(context_b, probs_b, values_b, first, keys)
            for q in T.serial(V):
                i = tile * V + q
                if i < length[0]:
                    for d in T.vectorized(D):
                        out[row_of(gather, b, i, R_OUT), h * D + d] = context_b[q, d] / total[q]

        return bf16_tile

    def _window_mask(self, k: _Kernel):
        """A macro: a sliding window's scores (of `keys` keys from `first` on) masked out of each query's window,
        and each query's largest score taken again; nothing without a window."""
        V, windowed, neg = k.V, k.windowed, tirx.const(NEG, "float32")

        @T.macro
        def window_mask(scores, top, tile, length, first, keys):
            for lane in T.vectorized(V):
                top[lane] = neg
            for j in T.serial(keys):
                for lane in T.vectorized(V):
                    scores[j, lane] = windowed(scores[j, lane], tile * V + lane, first + j, length)
                    top[lane] = T.max(top[lane], scores[j, lane])

        @T.macro
        def no_mask(scores, top, tile, length, first, keys):
            T.evaluate(0)

        return no_mask if k.shape.window is None else window_mask


class AmxProducts(Bf16Products):
    """The bf16 products on AMX tiles (attention_amx.py): the same operands and softmax, the keys and values
    staged to whole 32-key tiles, the values transposed, `[dims, S_MAX]`."""

    name = "amx"
    symbols = attention_amx

    def __init__(self, lanes: int):
        super().__init__(lanes)
        self.stage = attention_amx.KEY_STEP

    def _stage_values(self, k: _Kernel):
        D, S_MAX = k.D, k.S_MAX

        @T.macro
        def stage_values(values_b, values, staged):
            T.evaluate(_call(attention_amx.TRANSPOSE, _start(values_b, "w"), _start(values, "r"), staged, D, S_MAX))

        return stage_values

    def _context(self, k: _Kernel):
        S_MAX, context_symbol = k.S_MAX, self.symbols.CONTEXT.format(head=k.shape.head_size)

        @T.macro
        def context(context_b, probs_b, values_b, first, keys):  # zeroes the probabilities up to a whole tile
            T.evaluate(_call(context_symbol, _start(context_b, "w"), _start(probs_b, "rw"), _start(values_b, "r"),
                             S_MAX, (keys + _i64(1)) // _i64(2)))

        return context


class Int8Products:
    """The products in int8 (attention_int8.py, ymm or zmm): the staged keys and values, each tile's queries
    and its probabilities quantized, 16 queries a tile, keys staged to whole quads; operands as bytes in
    32-bit words typed float32, as the bf16 ones."""

    name = "int8"
    queries = attention_int8.QUERIES
    stage = attention_int8.KEY_STEP

    def __init__(self, lanes: int):
        del lanes  # the C routines' width is the object's (attention_int8.c_object)

    def products(self, k: _Kernel):
        """A macro: the operands quantized, then the tile loop."""
        S_MAX, TQ, D = k.S_MAX, k.TQ, k.D
        staged_keys, query_tiles, tile_of = k.staged, k.query_tiles, self._tile(k)
        biased, stage_score_bias = bool(k.shape.score_bias), k.stage_score_bias(1.0)

        @T.macro
        def products(q_src, bias, score_bias, gather, out, keys, values, b, h, length):
            scores = T.alloc_buffer((S_MAX, TQ), "float32")
            keys_q = T.alloc_buffer((S_MAX * D // _i64(4),), "float32")
            key_init = T.alloc_buffer((S_MAX,), "float32")  # int32
            key_scales = T.alloc_buffer((S_MAX,), "float32")
            values_q = T.alloc_buffer((S_MAX * D // _i64(4),), "float32")
            value_scales = T.alloc_buffer((D,), "float32")
            queries_q = T.alloc_buffer((D * TQ // _i64(4),), "float32")  # u8
            query_scales = T.alloc_buffer((TQ,), "float32")
            query_rows_q = T.alloc_buffer((TQ,), "int64", scope="local")
            probs_q = T.alloc_buffer((S_MAX // _i64(4) * TQ,), "float32")  # u8 quads
            context_q = T.alloc_buffer((TQ, D), "float32")
            tile_bias = T.alloc_buffer((S_MAX if biased else _i64(1), TQ), "float32")
            staged_q = staged_keys(length)
            T.evaluate(_call(attention_int8.STAGE_KEYS, _start(keys_q, "w"), _start(key_init, "w"),
                             _start(key_scales, "w"), _start(keys, "r"), staged_q, D))
            T.evaluate(_call(attention_int8.STAGE_VALUES, _start(values_q, "w"), _start(value_scales, "w"),
                             _start(values, "r"), staged_q, D))
            for tile in query_tiles(length):
                if biased:
                    stage_score_bias(tile_bias, score_bias, b, h, tile, length)
                tile_of(keys_q, key_init, key_scales, values_q, value_scales, queries_q, query_scales, query_rows_q,
                        scores, probs_q, context_q, q_src, bias, tile_bias, out, gather, b, h, tile, length)

        return products

    def _tile(self, k: _Kernel):
        """A macro: one tile of queries, its scaled queries quantized into dim quads straight from their rows,
        then scores, softmax and the normalised context in one call."""
        TQ, D, S, R_OUT, SCALE, row_of = k.TQ, k.D, k.S, k.R_OUT, k.SCALE, k.row_of
        tile_symbol, query_offsets = attention_int8.TILE.format(head=k.shape.head_size), k.query_offsets()
        tile_bias_of = _tile_bias_pointer(k)

        @T.macro
        def int8_tile(keys_q, key_init, key_scales, values_q, value_scales, queries_q, query_scales, query_rows, scores,
                      probs_q, context, q_src, bias, tile_bias, out, gather, b, h, tile, length):
            query_offsets(query_rows, gather, b, h, tile, length)
            T.evaluate(_call(attention_int8.QUERY_QUADS, _start(queries_q, "w"), _start(query_scales, "w"),
                             q_src.access_ptr("r"), query_rows.access_ptr("r"), SCALE, D))
            T.evaluate(_call(tile_symbol, _start(context, "w"), _start(queries_q, "r"), _start(query_scales, "r"),
                             _start(keys_q, "r"), _start(key_init, "r"), _start(key_scales, "r"),
                             _start(values_q, "r"), _start(value_scales, "r"), bias.access_ptr("r", offset=b * S),
                             tile_bias_of(tile_bias, _i64(0)), length[0], _start(scores, "w"), _start(probs_q, "w")))
            for q in T.serial(TQ):
                i = tile * TQ + q
                if i < length[0]:
                    for d in T.vectorized(D):
                        out[row_of(gather, b, i, R_OUT), h * D + d] = context[q, d]

        return int8_tile


def _score_bias_shape(shape: AttentionShape, B, S) -> tuple:
    if shape.score_bias == "relative":
        rows = shape.table_rows
        return (_i64(rows) if isinstance(rows, int) else rows, _i64(shape.heads))
    return (B if shape.score_bias == "batched" else _i64(1), _i64(shape.heads), S, S)


def _tile_bias_pointer(k: _Kernel):
    """What the C products read as the tile's score biases from key `first` on: the staged ones, or NULL (none)."""
    null = tirx.call_intrin("handle", "tirx.reinterpret", tirx.const(0, "uint64"))
    return ((lambda tile_bias, first: tile_bias.access_ptr("r", offset=first * k.TQ)) if k.shape.score_bias
            else (lambda tile_bias, first: null))


ARITHMETIC = {"fp32": Fp32Products, "bf16": Bf16Products, "amx": AmxProducts, "int8": Int8Products}


def _write_attention(shape: AttentionShape, lanes: int, products: str) -> tirx.PrimFunc:
    """The skeleton: per (sequence, head) task, its length, its keys and values staged, the arithmetic's
    products over the tiles of queries, and (padded layout) its padding rows zeroed."""
    arithmetic = ARITHMETIC[products](lanes)
    k = _Kernel.of(shape, lanes, arithmetic.queries, arithmetic.stage)
    H, D, S_MAX, B, S, R, R_OUT, NQ, SB, staged = k.H, k.D, k.S_MAX, k.B, k.S, k.R, k.R_OUT, k.NQ, k.SB, k.staged
    (NK, NV), (KO, VO) = (_i64(w) for w in shape.widths[1:]), (_i64(o) for o in shape.offsets[1:])
    zero, real_key, row_of = tirx.const(0.0, "float32"), tirx.const(REAL_KEY_BIAS, "float32"), k.row_of
    packed, MIN_WORK, arithmetic_products = shape.packed, _i64(MIN_PARALLEL_WORK), arithmetic.products(k)

    @T.macro
    def task(q_src, k_src, v_src, bias, score_bias, gather, out, bh):
        b = bh // H
        h = bh % H
        length = T.alloc_buffer((_i64(1),), "int64", scope="local")
        length[0] = _i64(0)
        for j in T.serial(S):
            if bias[b, _i64(0), _i64(0), j] > real_key:
                length[0] = j + _i64(1)
        # This head's keys and values of the sequence, staged contiguous (rows past the last real
        # key zero up to a whole tile): the products below then read them at fixed strides from one
        # pointer per tile, not through a clamped row gather per key of every query tile.
        keys = T.alloc_buffer((S_MAX, D), "float32")
        values = T.alloc_buffer((S_MAX, D), "float32")
        for j in T.serial(staged(length)):
            for d in T.vectorized(D):
                keys[j, d] = T.if_then_else(j < length[0], k_src[row_of(
                    gather, b, T.min(j, length[0] - _i64(1)), R), KO + h * D + d], zero)
                values[j, d] = T.if_then_else(j < length[0], v_src[row_of(
                    gather, b, T.min(j, length[0] - _i64(1)), R), VO + h * D + d], zero)
        arithmetic_products(q_src, bias, score_bias, gather, out, keys, values, b, h, length)
        if not packed:
            for i, d in T.grid(S - length[0], D):
                out[b * S + length[0] + i, h * D + d] = zero

    @script.prim_func(s_tir=True, private=True)  # the module's only public function is `main`
    def attention(q_src: T.Buffer((R, NQ), "float32"), k_src: T.Buffer((R, NK), "float32"),
                  v_src: T.Buffer((R, NV), "float32"), bias: T.Buffer((B, _i64(1), _i64(1), S), "float32"),
                  score_bias: T.Buffer(SB, "float32"), gather: T.Buffer((B, S), "int64"),
                  out: T.Buffer((R_OUT, H * D), "float32")):
        T.func_attr({"tirx.noalias": True})
        # the sequences' lengths are data: whether the pool's launch pays is judged by the bound
        if B * H * S * S * D >= MIN_WORK:
            for bh in T.parallel(B * H):
                task(q_src, k_src, v_src, bias, score_bias, gather, out, bh)
        else:
            for bh in T.serial(B * H):
                task(q_src, k_src, v_src, bias, score_bias, gather, out, bh)

    func = attention if packed else without_param(attention, "gather")  # the padded row map needs none
    func = func if shape.score_bias else without_param(func, "score_bias")
    func = claim_iterations(func, _i64(1))  # tasks claimed as threads come free
    return prescheduled(fast_math(func))
