/* The bf16 and int8 linears' tiles on AMX (compile/kernels/amx.py): each call computes a 32 x 32 block over
   the whole K as 2 x 2 accumulator tiles (tmm0-3) fed by 2 row tiles (tmm4-5) and 2 panel tiles (tmm6-7). */
#include "amx.h"

/* c[32][32] (row stride ldc) = a[32][GROUP * groups] x the panel b[groups][32][GROUP], in 2 x 2 accumulator
   tiles (tmm0-3) fed by 2 row tiles (tmm4-5) and 2 panel tiles (tmm6-7); groups is a multiple of 16 (one
   tile row of the activations: 64 bytes). The activations come blocked (tiles.blocked): 16 rows x 64
   bytes per block, contiguous, blocks in K order, the second 16 rows after the first's whole K. Tiles
   have no register renaming, so a load into a tile waits for the products still reading it: each load is
   placed just before the first product that needs it, the next step's first row tile after the last
   product of this one that reads it, and the next step's panel lines are prefetched (the order of
   Intel's mm_amx kernels). Against loading all four tiles, then the four products, whole MiniLM calls
   took 0.89-0.98x the time in bf16 and 0.90-1.04x in int8 (an interleaved `loadtest.bench --compare` of
   the two builds, docs/experiments/amx-tile-order.md). One step of K, expanded inside the tile function (it
   reads its a, b and strides). */
#define BERT_AMX_STEP(PRODUCT, GROUP, g, NEXT_ROW_TILE)        \
  _tile_loadd(6, b + (g) * 32 * GROUP, b_stride);              \
  PRODUCT(0, 4, 6);                                            \
  _tile_loadd(5, a + second_rows + 16 * GROUP * (g), 64);      \
  PRODUCT(2, 5, 6);                                            \
  _tile_loadd(7, b + (g) * 32 * GROUP + 16 * GROUP, b_stride); \
  PRODUCT(1, 4, 7);                                            \
  NEXT_ROW_TILE;                                               \
  PRODUCT(3, 5, 7);
#define BERT_AMX_TILE(NAME, C, A, B, GROUP, PRODUCT)                                     \
  int32_t NAME(C *c, int64_t ldc, const A *a, const B *b, int64_t groups) {              \
    const int64_t second_rows = 16 * GROUP * groups, b_stride = 32 * GROUP * sizeof(B);  \
    int64_t g = 0;                                                                       \
    bert_amx_configure();                                                                \
    _tile_zero(0);                                                                       \
    _tile_zero(1);                                                                       \
    _tile_zero(2);                                                                       \
    _tile_zero(3);                                                                       \
    _tile_loadd(4, a, 64);                                                               \
    for (; g + 16 < groups; g += 16) {                                                   \
      const char *next = (const char *)(b + (g + 16) * 32 * GROUP);                      \
      for (int line = 0; line < 32; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0); \
      BERT_AMX_STEP(PRODUCT, GROUP, g, _tile_loadd(4, a + 16 * GROUP * (g + 16), 64))    \
    }                                                                                    \
    BERT_AMX_STEP(PRODUCT, GROUP, g, (void)0)                                            \
    _tile_stored(0, c, ldc * 4);                                                         \
    _tile_stored(1, c + 16, ldc * 4);                                                    \
    _tile_stored(2, c + 16 * ldc, ldc * 4);                                              \
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);                                         \
    return 0;                                                                            \
  }

/* bf16 pairs into fp32, uint8 x int8 quads into int32 */
BERT_AMX_TILE(bert_amx_bf16_tile_32x32, float, uint16_t, uint16_t, 2, _tile_dpbf16ps)
BERT_AMX_TILE(bert_amx_int8_tile_32x32, int32_t, uint8_t, int8_t, 4, _tile_dpbusd)
