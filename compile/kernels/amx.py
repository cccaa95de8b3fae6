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
`llvm.x86.tdpbf16ps.internal` from TIR; the C compiler that links every library builds these.
"""

from __future__ import annotations

from pathlib import Path

import tvm

from . import attention_amx
from .objects import c_object
from .tiles import Tile

REQUIRED_FEATURES = ("amx-tile", "amx-bf16", "amx-int8", "avx512bw", "avx512bf16")
ROWS = 32  # activation rows per call: two row tiles
PANEL = 32  # output columns per call: two panel tiles, one weight panel of the AVX-512 kernels

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

#define BERT_ARCH_REQ_XCOMP_PERM 0x1023
#define BERT_XFEATURE_XTILEDATA 18

/* Ask Linux for the tile state once per process, when the library is loaded. */
__attribute__((constructor)) static void bert_amx_request_tiles(void) {
  syscall(SYS_arch_prctl, BERT_ARCH_REQ_XCOMP_PERM, BERT_XFEATURE_XTILEDATA);
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} bert_amx_config;

/* Palette 1, eight tiles of 16 rows x 64 bytes: loaded where the calling thread's tiles are configured
   otherwise (reading the configuration back costs little; loading it, a quarter of a 32 x 32 x 384 call). */
static inline void bert_amx_configure(void) {
  static const bert_amx_config ours = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  bert_amx_config current;
  _tile_storeconfig(&current);
  if (memcmp(&current, &ours, sizeof ours) != 0) _tile_loadconfig(&ours);
}

/* c[32][32] (row stride ldc) = a[32][GROUP * groups] x the panel b[groups][32][GROUP], in 2 x 2 accumulator
   tiles (tmm0-3) fed by 2 row tiles (tmm4-5) and 2 panel tiles (tmm6-7); groups is a multiple of 16 (one
   tile row of the activations: 64 bytes). The activations come blocked (tiles.blocked): 16 rows x 64
   bytes per block, contiguous, blocks in K order, the second 16 rows after the first's whole K. Tiles
   have no register renaming, so a load into a tile waits for the products still reading it: each load is
   placed just before the first product that needs it, the next step's first row tile after the last
   product of this one that reads it, and the next step's panel lines are prefetched (the order of
   Intel's mm_amx kernels). Against loading all four tiles, then the four products, whole MiniLM calls
   took 0.89-0.98x the time in bf16 and 0.90-1.04x in int8 (an interleaved `loadtest.bench --compare` of
   the two builds, docs/experiments/amx-tile-order.md). One step of K, expanded inside the tile function (it reads its
   a, b and strides). */
#define BERT_AMX_STEP(PRODUCT, GROUP, g, NEXT_ROW_TILE)                                                    \
  _tile_loadd(6, b + (g) * 32 * GROUP, b_stride);                                                        \
  PRODUCT(0, 4, 6);                                                                                      \
  _tile_loadd(5, a + second_rows + 16 * GROUP * (g), 64);                                                \
  PRODUCT(2, 5, 6);                                                                                      \
  _tile_loadd(7, b + (g) * 32 * GROUP + 16 * GROUP, b_stride);                                           \
  PRODUCT(1, 4, 7);                                                                                      \
  NEXT_ROW_TILE;                                                                                         \
  PRODUCT(3, 5, 7);
#define BERT_AMX_TILE(NAME, C, A, B, GROUP, PRODUCT)                                                     \
  int32_t NAME(C *c, int64_t ldc, const A *a, const B *b, int64_t groups) {                              \
    const int64_t second_rows = 16 * GROUP * groups, b_stride = 32 * GROUP * sizeof(B);                  \
    int64_t g = 0;                                                                                       \
    bert_amx_configure();                                                                                \
    _tile_zero(0);                                                                                       \
    _tile_zero(1);                                                                                       \
    _tile_zero(2);                                                                                       \
    _tile_zero(3);                                                                                       \
    _tile_loadd(4, a, 64);                                                                               \
    for (; g + 16 < groups; g += 16) {                                                                   \
      const char *next = (const char *)(b + (g + 16) * 32 * GROUP);                                      \
      for (int line = 0; line < 32; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);                 \
      BERT_AMX_STEP(PRODUCT, GROUP, g, _tile_loadd(4, a + 16 * GROUP * (g + 16), 64))                    \
    }                                                                                                    \
    BERT_AMX_STEP(PRODUCT, GROUP, g, (void)0)                                                            \
    _tile_stored(0, c, ldc * 4);                                                                         \
    _tile_stored(1, c + 16, ldc * 4);                                                                    \
    _tile_stored(2, c + 16 * ldc, ldc * 4);                                                              \
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);                                                         \
    return 0;                                                                                            \
  }

/* bf16 pairs into fp32, uint8 x int8 quads into int32 */
BERT_AMX_TILE(bert_amx_bf16_tile_32x32, float, uint16_t, uint16_t, 2, _tile_dpbf16ps)
BERT_AMX_TILE(bert_amx_int8_tile_32x32, int32_t, uint8_t, int8_t, 4, _tile_dpbusd)
"""


BF16 = Tile("bert_amx_bf16_tile_32x32", ROWS, PANEL, 2, 32, "uint16", "uint16", "float32", row_block=16)
INT8 = Tile("bert_amx_int8_tile_32x32", ROWS, PANEL, 4, 64, "uint8", "int8", "int32", row_block=16)
BF16_DESCRIPTION = ("amx tdpbf16ps (bf16 activations x bf16 weights in 32 x 32 tiles; avx512 vdpbf16ps where K is "
                    "not a multiple of 32), fp32 accumulation")
INT8_DESCRIPTION = ("amx tdpbusd (uint8 activations x int8 weights, 32 x 32 tiles; avx512 vnni vpdpbusd where K is "
                    "not a multiple of 64), int32 accumulation")


def kernels_object() -> Path:
    """The tiles, compiled once per process to an object file the libraries link."""
    return c_object("amx_tiles", SOURCE + attention_amx.SOURCE,
                    ("-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512bf16"))


def linked_objects(mod: tvm.IRModule, amx_tiles: bool, products: str = "fp32") -> list[str]:
    """The tiles' object where a library built from `mod` runs its bf16 or int8 linears on them
    (compile/kernels/bf16.py and int8.py schedule them so where the target has them, `amx_tiles`) or
    attention's products (`products` "amx")."""
    from . import bf16, int8  # they schedule onto these tiles: imported here, not at the top

    linears = (bf16.MATMUL, int8.MATMUL)
    uses = products == "amx" or any(isinstance(func, tvm.tirx.PrimFunc) and gvar.name_hint.startswith(linears)
                                     for gvar, func in mod.functions_items())
    return [str(kernels_object())] if uses and amx_tiles else []
