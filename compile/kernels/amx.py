"""The AMX kernel family (Sapphire Rapids and later: AMX-BF16 and AMX-INT8): the bf16 and int8
linears' tiles on the CPU's tile matrix unit.

One `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums: 8192
multiply-adds (an AVX-512 `vdpbf16ps`: 32). One `tdpbusd`: 16 x 64 u8 by 64 x 16 s8, 16384 (`vpdpbusd`:
64). The tiles read the weight panels the AVX-512 kernels already use: a bf16 panel
`[K / 2, 32, 2]` is two tiles of 16 k pairs x 16 columns at a 128-byte row stride, an int8 VNNI
panel `[K / 4, 32, 4]` two of 16 k quads x 16 columns, so the artifact's weights and the activations'
rounding or quantisation are the AVX-512 kernels'. The activations are read in blocks of 16 rows x
64 bytes, one row tile each (`tiles.blocked`), which the linear's copy of them writes. Each call
computes a 32 x 32 block over the whole K as 2 x 2 accumulator tiles (tmm0-3) fed by 2 row tiles
(tmm4-5) and 2 panel tiles (tmm6-7): the 8 tiles there are, each row and panel tile used twice.

Linux hands a process the 8 KB of tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`):
the libraries' constructor asks once, when they are loaded. Each call reads the thread's tile
configuration back (`sttilecfg`) and loads its own where it differs: other code in the process
(another runtime's AMX kernels on the same thread) may have configured the tiles otherwise.

Why C, as the bf16 tile: TVM 0.27's LLVM code generator has no tile type (`x86_amx`) to call
`llvm.x86.tdpbf16ps.internal` from TIR; the C compiler that links every library builds these (c/amx_tiles.c).
"""

from __future__ import annotations

from pathlib import Path

from .objects import CObject
from .tiles import Tile

REQUIRED_FEATURES = ("amx-tile", "amx-bf16", "amx-int8", "avx512bw", "avx512bf16")
ROWS = 32  # activation rows per call: two row tiles
PANEL = 32  # output columns per call: two panel tiles, one weight panel of the AVX-512 kernels

BF16 = Tile("bert_amx_bf16_tile_32x32", ROWS, PANEL, 2, 32, "uint16", "uint16", "float32", row_block=16)
INT8 = Tile("bert_amx_int8_tile_32x32", ROWS, PANEL, 4, 64, "uint8", "int8", "int32", row_block=16)
ISA = ("-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512bf16")  # the C's (c/amx*)
TILES_OBJECT = CObject("amx_tiles.c", frozenset({BF16.symbol, INT8.symbol}), ISA)
BF16_DESCRIPTION = ("amx tdpbf16ps (bf16 activations x bf16 weights in 32 x 32 tiles; avx512 vdpbf16ps where K is "
                    "not a multiple of 32), fp32 accumulation")
INT8_DESCRIPTION = ("amx tdpbusd (uint8 activations x int8 weights, 32 x 32 tiles; avx512 vnni vpdpbusd where K is "
                    "not a multiple of 64), int32 accumulation")


def kernels_object() -> Path:
    """The linears' tiles (c/amx_tiles.c), compiled once per process to an object file the libraries link."""
    return TILES_OBJECT.build()
