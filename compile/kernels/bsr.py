"""The block-sparse linears' CPU micro-kernels (c/bsr.c): y[M, N] = x[M, K] @ W^T over W's non-zero blocks,
each weight stored in the precision the compile chose for it (compile/passes/sparsity.py times and gates them).

Storages, each a `Storage`:
  f32    fp32 blocks, fp32 FMA (the seed's kernel, register-tiled);
  bf16w  bf16 blocks widened in the register, fp32 FMA (half the bytes streamed; activations stay fp32);
  i8w    int8 blocks (per output row scales, applied on write-back), fp32 FMA (a quarter of the bytes);
  vnni   16 x 4 int8 blocks x the tile's activations quantised per row onto u8 with a zero point, `vpdpbusd`;
  vnni_gather  16 x 1 int8 blocks taken in fours of any k, the same activations a k per line, `vpdpbusd`.

Block shapes without padding: the FMA storages widen a block column of R rows into R / lanes vectors, so any
R that is 1, 2 or 4 vectors and any C run as they are (16x1, 32x1, 16x4 on AVX-512; 8x1, 16x1, 32x1 on AVX2).
`vpdpbusd` sums 4 k of a row in one int32 lane: vnni's block is 16 x 4 (one zmm), 4 consecutive k; a weight
pruned in 16 x 1 blocks runs there as the 16 x 4 blocks that hold any of its non-zeros, zeros included (at 10%
density, about a third of them), or on vnni_gather, which packs each block row's 16 x 1 blocks in fours and
interleaves the four k's activation lines in the register (no zeros multiplied; 8 shuffles a four). `vdpbf16ps` would pair 2 k: bf16
activations would then round too, so bf16 blocks are widened instead and keep fp32 activations.

A call prepares each tile of activation rows once (transposed, or vnni: quantised), then runs tasks of (row
tile, range of block rows) in parallel; each streams its block rows' blocks once for all the tile's rows
(`c/bsr.c`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from . import script
from .common import prescheduled, without_param
from .objects import CObject, load_in_process

TASKS = 64  # tasks a call aims at: several per core, so that threads that finish early take more
ACCUMULATORS = {16: 16, 8: 8}  # fp32 vector accumulators of one tile, by lanes (c/bsr.c's ACCUMULATORS)
VNNI_BLOCK = (16, 4)
VNNI_TILE = 16


@dataclass(frozen=True)
class Storage:
    """One way to store a sparse weight and the kernel that reads it."""

    name: str
    weights: str  # dtype of the stored blocks
    scaled: bool  # per output row scales (int8 blocks)
    description: str


STORAGES = {
    "f32": Storage("f32", "float32", False, "fp32 blocks, fp32 FMA"),
    "bf16w": Storage("bf16w", "uint16", False, "bf16 blocks widened to fp32, fp32 FMA"),
    "i8w": Storage("i8w", "int8", True, "int8 blocks (per-row scales) widened to fp32, fp32 FMA"),
    "vnni": Storage("vnni", "int8", True, "16x4 int8 blocks x per-row u8 activations, vpdpbusd"),
    "vnni_gather": Storage("vnni_gather", "int8", True,
                           "16x1 int8 blocks in fours of any k x per-row u8 activations, vpdpbusd"),
}
QUANTISED = frozenset({"vnni", "vnni_gather"})  # the storages whose kernels quantise the activations
GATHER_BLOCK = (16, 1)

FMA_OBJECTS = {
    16: CObject("bsr.c", frozenset({f"bert_bsr_{s}_v16" for s in ("rows", "f32", "bf16w", "i8w")}),
                ("-mavx512f", "-mavx512bw"), (("BERT_LANES", 16),), "v16"),
    8: CObject("bsr.c", frozenset({f"bert_bsr_{s}_v8" for s in ("rows", "f32", "bf16w", "i8w")}),
               ("-mavx2", "-mfma"), (("BERT_LANES", 8),), "v8"),
}
VNNI_OBJECT = CObject("bsr.c", frozenset({f"bert_bsr_{s}_v16" for s in
                                           ("vnni_rows", "vnni", "vnni_gather_rows", "vnni_gather")}),
                      ("-mavx512f", "-mavx512bw", "-mavx512vnni"), (("BERT_LANES", 16), ("BERT_BSR_VNNI", 1)), "vnni")
OBJECTS = (*FMA_OBJECTS.values(), VNNI_OBJECT)


def symbol(storage: str, lanes: int) -> str:
    return f"bert_bsr_{storage}_v{16 if storage in QUANTISED else lanes}"


def fits(storage: str, block: tuple[int, int], lanes: int, vnni: bool, k: int, n: int) -> bool:
    """Whether `storage`'s kernel runs a weight [n, k] of `block`s on a CPU of `lanes` (and VNNI)."""
    if storage == "vnni":
        return vnni and lanes == 16 and k % VNNI_BLOCK[1] == 0 and n % VNNI_BLOCK[0] == 0
    if storage == "vnni_gather":
        return vnni and lanes == 16 and tuple(block) == GATHER_BLOCK and k % 16 == 0 and n % 16 == 0
    return lanes in ACCUMULATORS and block[0] % lanes == 0 and block[0] // lanes in (1, 2, 4)


def block_of(storage: str, block: tuple[int, int]) -> tuple[int, int]:
    """The block `storage` stores a weight pruned in `block`s as."""
    return VNNI_BLOCK if storage == "vnni" else block


def tile_rows(storage: str, block: tuple[int, int], lanes: int) -> int:
    """Activation rows per task (c/bsr.c's TILE_<RV>)."""
    return VNNI_TILE if storage in QUANTISED else ACCUMULATORS[lanes] // (block[0] // lanes)


# ----------------------------------------------------------------------------- weights


def blocks_of(weight: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`weight` [N, K] viewed as [N/R, K/C, R, C] blocks; refuses shapes the block does not divide."""
    rows, cols = block
    if weight.ndim != 2 or weight.shape[0] % rows or weight.shape[1] % cols:
        raise ValueError(f"block {rows}x{cols} does not divide weight of shape {tuple(weight.shape)}")
    n, k = weight.shape
    return weight.reshape(n // rows, rows, k // cols, cols).transpose(0, 2, 1, 3)


def to_bsr(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight` [N, K] as BSR: data [nnz, R, C], indices [nnz] (block columns), indptr [N/R + 1].

    Blocks are stored row-major, so each block row's blocks are contiguous in `data`. An all-zero
    weight still stores one zero block, to keep every buffer non-empty.
    """
    blocks = blocks_of(weight, block)
    nonzero = np.any(blocks != 0, axis=(2, 3))
    if not nonzero.any():
        nonzero[0, 0] = True
    data = np.ascontiguousarray(blocks[nonzero])
    indices = np.nonzero(nonzero)[1].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(nonzero.sum(axis=1))]).astype(np.int32)
    return data, indices, indptr




def _round_bf16(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def row_scales(weight: np.ndarray) -> np.ndarray:
    """Per output row: max |W[n, :]| / 127 (1 for an all-zero row)."""
    largest = np.abs(weight).max(axis=1)
    return np.where(largest > 0, largest / 127.0, 1.0).astype(np.float32)


def quantized(weight: np.ndarray) -> np.ndarray:
    """W in int8 codes of `row_scales` (what i8w and the vnni storages store)."""
    return np.clip(np.rint(weight / row_scales(weight)[:, None]), -127, 127).astype(np.int8)


def stored_weight(storage: str, weight: np.ndarray) -> np.ndarray:
    """The fp32 weight `storage`'s blocks hold (its rounding): what its kernel multiplies by."""
    if storage == "bf16w":
        return (_round_bf16(weight).astype(np.uint32) << 16).view(np.float32)
    if STORAGES[storage].scaled:
        return quantized(weight).astype(np.float32) * row_scales(weight)[:, None]
    return weight.astype(np.float32)


def pack(storage: str, weight: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """The kernel's arrays for `weight` [N, K], in its argument order: blocks (fp32 storages: [nnz, C, R],
    a block column contiguous; vnni: [nnz, 16, 4], a row's 4 k in one int32 lane; vnni_gather: [fours, 16, 4]),
    per-row scales, per-row sums of the stored codes (vnni storages), each block's first k (vnni_gather: each
    four's 4 k), and the block rows' starts."""
    rows, cols = block_of(storage, block)
    values = quantized(weight) if STORAGES[storage].scaled else weight.astype(np.float32)
    data, indices, indptr = to_bsr(values, (rows, cols))
    if storage == "vnni_gather":
        data, indices, indptr = _in_fours(data, indices, indptr)
    elif storage != "vnni":
        data = data.transpose(0, 2, 1)
    if storage == "bf16w":
        data = _round_bf16(data)
    arrays = {"data": np.ascontiguousarray(data)}
    if STORAGES[storage].scaled:
        arrays["scales"] = row_scales(weight)
    if storage in QUANTISED:
        arrays["colsum"] = values.astype(np.int32).sum(axis=1).astype(np.int32)
    arrays["offsets"] = (indices.reshape(-1) * cols).astype(np.int32)
    arrays["indptr"] = indptr
    return arrays


def _in_fours(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray) -> tuple[np.ndarray, ...]:
    """16 x 1 blocks [nnz, 16, 1] as fours [fours, 16, 4] per block row (the last four of a row padded with zero
    blocks at its first block's k), with each four's 4 block columns [fours, 4] and the rows' first fours."""
    fours, columns, starts = [], [], [0]
    for br in range(len(indptr) - 1):
        first, last = int(indptr[br]), int(indptr[br + 1])
        count = -(-(last - first) // 4) * 4
        blocks = np.zeros((count, 16), data.dtype)
        blocks[:last - first] = data[first:last, :, 0]
        at = np.full(count, indices[first] if last > first else 0, np.int32)
        at[:last - first] = indices[first:last]
        fours.append(blocks.reshape(-1, 4, 16).transpose(0, 2, 1))
        columns.append(at.reshape(-1, 4))
        starts.append(starts[-1] + count // 4)
    return np.concatenate(fours), np.concatenate(columns), np.asarray(starts, np.int32)


# ----------------------------------------------------------------------------- the kernel


def bsr_kernel(storage: str, m, k: int, n: int, arrays: dict[str, np.ndarray], block: tuple[int, int],
               lanes: int) -> tirx.PrimFunc:
    """The PrimFunc for one packed weight (`pack`), generic in M (an int or a symbolic int64 var): out[M, N].
    Two parallel loops: each tile of rows prepared once (transposed; vnni: quantised), then the tasks (the C
    routines take sizes and indices as int32: c/bsr.c says why)."""
    block = block_of(storage, block)
    obj = VNNI_OBJECT if storage in QUANTISED else FMA_OBJECTS[lanes]
    load_in_process(obj.build())  # the compile times the kernels it builds in this process
    i64 = lambda value: tirx.IntImm("int64", value)  # noqa: E731
    M = i64(m) if isinstance(m, int) else m
    K, N, TILE = i64(k), i64(n), i64(tile_rows(storage, block, lanes))
    BLOCK_ROWS = i64(n // block[0])
    name = symbol(storage, lanes)
    data_shape, data_dtype = tuple(i64(d) for d in arrays["data"].shape), str(arrays["data"].dtype)
    scales_shape = (i64(len(arrays["scales"])),) if "scales" in arrays else (i64(1),)
    colsum_shape = (i64(len(arrays["colsum"])),) if "colsum" in arrays else (i64(1),)
    nnz, starts = i64(len(arrays["offsets"])), i64(len(arrays["indptr"]))
    quantised = storage in QUANTISED
    rows_per_tile = TILE * K // i64(4) if quantised else TILE * K  # u8 codes in fours, or fp32
    TILES = (M + TILE - i64(1)) // TILE
    CHUNKS = tirx.max(i64(1), tirx.min(BLOCK_ROWS, (i64(TASKS) + TILES - i64(1)) // TILES))

    @script.prim_func(s_tir=True, private=True)
    def bsr(x: T.Buffer((M, K), "float32"), data: T.Buffer(data_shape, data_dtype),
            scales: T.Buffer(scales_shape, "float32"), colsum: T.Buffer(colsum_shape, "int32"),
            offsets: T.Buffer(nnz, "int32"), indptr: T.Buffer(starts, "int32"),
            out: T.Buffer((M, N), "float32")):
        T.func_attr({"tirx.noalias": True})
        # one workspace: the prepared rows, then (vnni) each row's scale and zero point, in 32-bit words
        rows = T.alloc_buffer((TILES * (rows_per_tile + TILE * i64(2)),), "float32")
        for tile in T.parallel(TILES):
            T.evaluate(_rows_call(storage, lanes, block, rows, TILES * rows_per_tile, TILES * TILE, x, M, K, tile))
        for task in T.parallel(TILES * CHUNKS):
            T.evaluate(_call(name, storage, block, out, rows, TILES * rows_per_tile, TILES * TILE, M, K, N, data,
                             scales, colsum, offsets, indptr, task // CHUNKS, task % CHUNKS, CHUNKS))

    func = bsr
    for optional in ("scales", "colsum"):
        if optional not in arrays:
            func = without_param(func, optional)
    return prescheduled(func)


def _rows_call(storage, lanes, block, rows, scales_at, tile_rows_total, x, m, k, tile):
    """The first loop's C routine: one tile of rows transposed (or, vnni, quantised: codes, then each row's
    scale and zero point after `scales_at` words)."""
    if storage in QUANTISED:
        return T.call_extern("int32", f"bert_bsr_{storage}_rows_v16", rows.access_ptr("w"),
                             rows.access_ptr("w", offset=scales_at), rows.access_ptr("w", offset=scales_at + tile_rows_total),
                             x.access_ptr("r"), m, k, tile)
    return T.call_extern("int32", f"bert_bsr_rows_v{lanes}", rows.access_ptr("w"), x.access_ptr("r"), m, k,
                         tirx.IntImm("int64", block[0]), tile)


def _call(name, storage, block, out, rows, scales_at, tile_rows_total, m, k, n, data, scales, colsum, offsets,
          indptr, tile, chunk, chunks):
    """The second loop's C routine: its pointer and size arguments in c/bsr.c's order."""
    args = [out.access_ptr("w"), rows.access_ptr("r")]
    if storage in QUANTISED:
        args += [rows.access_ptr("r", offset=scales_at), rows.access_ptr("r", offset=scales_at + tile_rows_total)]
    args += [m, k, n, data.access_ptr("r")]
    if STORAGES[storage].scaled:
        args.append(scales.access_ptr("r"))
    if storage in QUANTISED:
        args.append(colsum.access_ptr("r"))
    args += [offsets.access_ptr("r"), indptr.access_ptr("r")]
    if storage not in QUANTISED:
        args += [tirx.IntImm("int64", block[0]), tirx.IntImm("int64", block[1])]
    return T.call_extern("int32", name, *args, tile, chunk, chunks)
