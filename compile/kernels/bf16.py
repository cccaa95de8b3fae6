"""The bf16 kernel family for x86 CPUs with AVX512_BF16: linears over bf16 weights, fp32 accumulation.

Weights are rounded to bf16 at compile time (round to nearest even) and stored as their 16-bit
patterns (uint16: nothing in the runtime needs a bf16 type) in panels of `PANEL` output columns with
the reduction axis in pairs, `Wp[N / 32, K / 2, 32, 2]`: one k pair of a panel is 128 contiguous
bytes, two zmm registers. Activations are rounded to bf16 per call (`to_bf16_te`). The loop nest is
the int8 kernel's (parallel over panels, an 8 x 32 fp32 accumulator tile per 8 rows, any fused
epilogue applied on write-back), but the whole K loop of a tile is one call of a micro-kernel
(c/bf16_tile.c): per k pair, two panel loads and 8 row-pair broadcasts feed 16 `vdpbf16ps`, each
32 multiply-adds into 16 fp32 lanes (an fp32 FMA does 16), all 16 accumulators in registers.

Why a C micro-kernel: TVM 0.27's LLVM code generator has no bfloat vector type (its BF16 legalizer
widens bf16 to fp32 before code generation), so `llvm.x86.avx512bf16.dpbf16ps.512`, whose operands
are `<32 x bfloat>`, cannot be called from TIR. The tile is compiled by the C compiler that links
every library anyway (`kernels_object`) and linked in (`build_library`'s addons).
"""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import s_tir, te, tirx

from . import amx
from .objects import CObject
from .tiles import Tile, schedule_tiles

PANEL = 32  # output columns per weight panel: two zmm of fp32
ROWS = 8  # activation rows per tile: 8 x 2 accumulators of 32 zmm
PAIR = 2  # k values one fp32 lane sums per vdpbf16ps
STORAGE = "uint16"  # bf16 bit patterns
TO_BF16 = "to_bf16"
MATMUL = "bf16_matmul"
PANEL_VIEW = "bf16_panel_view"
ROW_VIEW = "bf16_row_view"
TILE_SYMBOL = "bert_bf16_tile_8x32"
TILE = Tile(TILE_SYMBOL, ROWS, PANEL, PAIR, PAIR, STORAGE, STORAGE, "float32")
REQUIRED_FEATURES = ("avx512f", "avx512bf16")
DESCRIPTION = "avx512 bf16 vdpbf16ps (bf16 activations x bf16 weights), fp32 accumulation"

ISA = ("-mavx512f", "-mavx512bw", "-mavx512bf16")  # what the C of the bf16 kernels is compiled for
TILE_OBJECT = CObject("bf16_tile.c", frozenset({TILE_SYMBOL}), ISA)


def kernels_object() -> Path:
    """The linears' micro-kernel (c/bf16_tile.c) compiled once per process to an object file the libraries
    link."""
    return TILE_OBJECT.build()


# ----------------------------------------------------------------------------- TE kernels


def _widen(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    """The fp32 value of a bf16 bit pattern (exact: bf16 is fp32's upper half)."""
    return tirx.reinterpret("float32", bits.astype("uint32") << tirx.const(16, "uint32"))


def to_bf16_te(x: te.Tensor) -> te.Tensor:
    """x (fp32) rounded to the nearest bf16 (ties to even), as bit patterns."""

    def rounded(*index):
        bits = tirx.reinterpret("uint32", x(*index))
        odd = (bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32")
        return ((bits + tirx.const(0x7FFF, "uint32") + odd) >> tirx.const(16, "uint32")).astype(STORAGE)

    return te.compute(x.shape, rounded, name=TO_BF16)


def bf16_matmul_te(xb: te.Tensor, panels: te.Tensor) -> te.Tensor:
    """y[M, N] = xb @ W^T in fp32, W given as panels Wp[j // 32, k // 2, j % 32, k % 2] (bf16 bits).

    Both operands are first widened to fp32 by (inlinable) views, so the matmul block itself is a
    plain `C += A * B`: TVM's pattern analysis then calls the kernel out-elementwise-fusable, and
    FuseOps fuses the bias / GELU / residual epilogue (and the next linear's rounding) into it, as
    it does the fp32 kernel's. The schedule inlines the views before tensorizing.
    """
    count, pairs, width, pair = (int(d) for d in panels.shape)
    rows = te.compute(xb.shape, lambda m, kk: _widen(xb[m, kk]), name=ROW_VIEW)
    weight = te.compute((_i64(count * width), _i64(pairs * pair)),
                        lambda j, kk: _widen(panels[j // width, kk // pair, j % width, kk % pair]), name=PANEL_VIEW)
    k = te.reduce_axis((0, _i64(pairs * pair)), name="k")
    return te.compute((xb.shape[0], weight.shape[0]), lambda m, j: te.sum(rows[m, k] * weight[j, k], axis=k),
                      name=MATMUL)


def te_kernels() -> dict[str, tuple]:
    """Our bf16 TE kernels by primfunc name, as compile/passes/specialize.py rewrites them."""
    return {TO_BF16: (to_bf16_te, 1), MATMUL: (bf16_matmul_te, 2)}


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)


# ----------------------------------------------------------------------------- schedule


def _bf16_matmul_block(sch: s_tir.Schedule):
    """The block accumulating bf16 activations x bf16 weights in fp32 (its rows' widening view
    inlined), or None."""
    rows = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint.startswith(ROW_VIEW)]
    if len(rows) != 1:
        return None
    sch.compute_inline(rows[0])  # the panel view after `pad_einsum`, which needs plain indices
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if (len(stmt.reads) == 2 and len(stmt.writes) == 1 and stmt.writes[0].source.dtype == "float32"
                and stmt.reads[0].source.dtype == STORAGE and stmt.reads[1].source.name.startswith(PANEL_VIEW)
                and len(stmt.iter_vars) == 3):
            return block
    return None


def schedule_bf16_matmul(func: tirx.PrimFunc, amx_tiles: bool = False) -> s_tir.Schedule | None:
    """Schedule the bf16 matmul (and its fused epilogue) of `func` as whole-K tile calls
    (`tiles.schedule_tiles`), or None when it has none: AMX's 32 x 32 tile where `amx_tiles` (the target
    has it, `Capabilities.amx`) and K is a multiple of its step, else the 8 x 32 AVX-512 tile."""
    sch = s_tir.Schedule(func)
    main = _bf16_matmul_block(sch)
    if main is None:
        return None
    k_size = sch.get(sch.get_loops(main)[-1]).extent
    tile = amx.BF16 if amx_tiles and amx.BF16.fits(k_size) else TILE
    if not tile.fits(k_size):
        return None
    return schedule_tiles(sch, main, tile, PANEL_VIEW)
