/* The block-sparse linears' micro-kernels (compile/kernels/bsr.py): y[M, N] = x[M, K] @ W^T, W [N, K] stored
   as its non-zero R x C blocks, block row by block row (BSR), each block laid out column by column (C runs of
   R output rows), so one column of a block is R contiguous weights: R / BERT_LANES vectors.

   A call is two parallel loops. The first copies each tile of TILE activation rows transposed (xt[k][row]:
   one k of every row contiguous; `..._rows`), once per call; in the second, each task takes one tile against
   a range of block rows, so each weight vector loaded from a block feeds TILE row accumulators through
   broadcasts of xt, and a block is read once per tile, not once per row. Weights are stored in the precision the compile chose for them:
     f32   fp32 weights, fp32 FMA;
     bf16w bf16 weights widened to fp32 in the register (a shift), fp32 FMA: half the bytes streamed;
     i8w   int8 weights widened and scaled per output row on write-back, fp32 FMA: a quarter of them;
     vnni  (zmm, AVX512_VNNI, 16 x 4 blocks only) int8 weights x the tile's activations quantised per row
           onto u8 with a zero point, `vpdpbusd` (4 k values per int32 lane: a 16 x 4 block is one zmm);
     vnni_gather (zmm, AVX512_VNNI, 16 x 1 blocks) the same, a block row's blocks in fours of any k.
   Which one a weight gets is timed and gated by the compile (compile/passes/sparsity.py).

   Sizes and indices arrive as int32: TVM narrows the int64 indices of loops of a constant extent to int32
   and passes them as such, a 4-byte value in a stack slot where the arguments run past the registers; an
   int32 parameter reads the same value either way. */
#include "kernels.h"

#if BERT_LANES == 16
#ifndef __AVX512F__
#error "BERT_LANES 16 (zmm) needs AVX512F"
#endif
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOAD_BF16(p) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define ACCUMULATORS 16 /* of the 32 zmm: the rest hold a block's vectors and the broadcasts */
#elif BERT_LANES == 8
#ifndef __AVX2__
#error "BERT_LANES 8 (ymm) needs AVX2"
#endif
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOAD_BF16(p) \
  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define ACCUMULATORS 8 /* of the 16 ymm */
#else
#error "BERT_LANES is 8 (ymm) or 16 (zmm)"
#endif

#define PREFETCH_BLOCKS 8 /* blocks ahead of the one being read */
#define STORAGE_F32 0
#define STORAGE_BF16 1
#define STORAGE_I8 2

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define SYMBOL(name) CAT(CAT(bert_bsr_, name), CAT(_v, BERT_LANES))

#ifndef BERT_BSR_VNNI /* the fp32-FMA kernels; with it, the vnni kernel alone (its own object) */
static inline vf load_weights(const void *data, int64_t at, int storage) {
  if (storage == STORAGE_BF16) return VLOAD_BF16((const uint16_t *)data + at);
  if (storage == STORAGE_I8) return VLOAD_I8((const int8_t *)data + at);
  return VLOAD((const float *)data + at);
}

static inline int64_t element_size(int storage) { return storage == STORAGE_F32 ? 4 : storage == STORAGE_BF16 ? 2 : 1; }

/* xt[k][tile] = x[row0 + row][k] for the tile's rows, zero past the last row. */
static void transpose_rows(float *xt, const float *x, int64_t row0, int64_t rows, int64_t k, int64_t tile) {
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t row = 0; row < tile; ++row) xt[kk * tile + row] = row < rows ? x[(row0 + row) * k + kk] : 0.0f;
  }
}

/* Rows per tile for a block of R = RV vectors, and the rows a tile's task runs on: a tail of at most a
   quarter tile runs on a quarter tile (one row does not pay for a whole one). */
static inline int64_t tile_of(int64_t rows_per_block) { return ACCUMULATORS / (rows_per_block / BERT_LANES); }
static inline int64_t used_rows(int64_t m, int64_t row0, int64_t tile) {
  const int64_t rows = m - row0 < tile ? m - row0 : tile, quarter = tile >= 4 ? tile / 4 : 1;
  return rows <= quarter ? quarter : tile;
}

/* The first loop: tile `tile_index` of x[M][K] transposed into xt (k * TILE floats per tile). */
int32_t SYMBOL(rows)(float *xt, const float *x, int32_t m, int32_t k, int32_t rows_per_block, int32_t tile_index) {
  const int64_t tile = tile_of(rows_per_block), row0 = tile_index * tile;
  const int64_t rows = m - row0 < tile ? m - row0 : tile;
  transpose_rows(xt + tile_index * k * tile, x, row0, rows, k, used_rows(m, row0, tile));
  return 0;
}

/* The register tile: TILE rows x RV vectors of R = RV * BERT_LANES outputs, over block rows [br0, br1), one
   function per (TILE, RV, storage): with literal bounds the loops over them unroll and acc stays in registers. */
#define DEFINE_TILE(TILE, RV, STORAGE)                                                                          \
  static void CAT(CAT(CAT(tile_, TILE), CAT(_, RV)), CAT(_, STORAGE))(                                          \
      float *out, int64_t ldo, int64_t row0, int64_t rows, const float *xt, const void *data,                   \
      const float *scales, const int32_t *offsets, const int32_t *indptr, int64_t cols, int64_t br0,            \
      int64_t br1) {                                                                                            \
    const int64_t R = (RV) * BERT_LANES, block = R * cols;                                                      \
    for (int64_t br = br0; br < br1; ++br) {                                                                    \
      vf acc[TILE][RV];                                                                                         \
      _Pragma("GCC unroll 16") for (int t = 0; t < (TILE); ++t)                                                 \
          _Pragma("GCC unroll 4") for (int v = 0; v < (RV); ++v) acc[t][v] = VZERO();                           \
      for (int64_t j = indptr[br]; j < indptr[br + 1]; ++j) {                                                   \
        _mm_prefetch((const char *)data + (j + PREFETCH_BLOCKS) * block * element_size(STORAGE), _MM_HINT_T0);  \
        const float *column = xt + (int64_t)offsets[j] * (TILE);                                                \
        const int64_t first = j * block;                                                                        \
        for (int64_t c = 0; c < cols; ++c) {                                                                    \
          vf w[RV];                                                                                             \
          _Pragma("GCC unroll 4") for (int v = 0; v < (RV); ++v)                                                \
              w[v] = load_weights(data, first + c * R + v * BERT_LANES, STORAGE);                               \
          _Pragma("GCC unroll 16") for (int t = 0; t < (TILE); ++t) {                                           \
            const vf xb = VSET1(column[c * (TILE) + t]);                                                        \
            _Pragma("GCC unroll 4") for (int v = 0; v < (RV); ++v) acc[t][v] = VFMA(w[v], xb, acc[t][v]);       \
          }                                                                                                     \
        }                                                                                                       \
      }                                                                                                         \
      _Pragma("GCC unroll 4") for (int v = 0; v < (RV); ++v) {                                                  \
        const vf scale = (STORAGE) == STORAGE_I8 ? VLOAD(scales + br * R + v * BERT_LANES) : VSET1(1.0f);       \
        _Pragma("GCC unroll 16") for (int t = 0; t < (TILE); ++t) if (t < rows)                                 \
            VSTORE(out + (row0 + t) * ldo + br * R + v * BERT_LANES,                                            \
                   (STORAGE) == STORAGE_I8 ? VMUL(acc[t][v], scale) : acc[t][v]);                               \
      }                                                                                                         \
    }                                                                                                           \
  }

/* rows per tile for RV = 1, 2, 4 vectors per block column (ACCUMULATORS / RV), and their quarters (the tail) */
#if BERT_LANES == 16
#define TILE_1 16
#define QUARTER_1 4
#define TILE_2 8
#define QUARTER_2 2
#define TILE_4 4
#define QUARTER_4 1
#else
#define TILE_1 8
#define QUARTER_1 2
#define TILE_2 4
#define QUARTER_2 1
#define TILE_4 2
#define QUARTER_4 1
#endif
#define FOR_EACH_TILE(STORAGE) DEFINE_TILE(TILE_1, 1, STORAGE) DEFINE_TILE(QUARTER_1, 1, STORAGE) \
  DEFINE_TILE(TILE_2, 2, STORAGE) DEFINE_TILE(QUARTER_2, 2, STORAGE) DEFINE_TILE(TILE_4, 4, STORAGE) \
  DEFINE_TILE(QUARTER_4, 4, STORAGE)
FOR_EACH_TILE(0)
FOR_EACH_TILE(1)
FOR_EACH_TILE(2)
#define TILE_FN(TILE, RV, STORAGE) CAT(CAT(CAT(tile_, TILE), CAT(_, RV)), CAT(_, STORAGE))

/* One task of the fp32-FMA kernels: row tile `tile_index` x the `chunk`-th of `chunks` ranges of block rows. */
#define DEFINE_TASK(STORAGE)                                                                                    \
  static int32_t CAT(task_, STORAGE)(float *out, const float *x, int64_t m, int64_t k, int64_t n,               \
                                     const void *data, const float *scales, const int32_t *offsets,            \
                                     const int32_t *indptr, int64_t rows_per_block, int64_t cols,              \
                                     int64_t tile_index, int64_t chunk, int64_t chunks) {                      \
    const int64_t RV = rows_per_block / BERT_LANES, tile = tile_of(rows_per_block), block_rows = n / rows_per_block; \
    const int64_t row0 = tile_index * tile, rows = m - row0 < tile ? m - row0 : tile;                         \
    const int64_t per_chunk = (block_rows + chunks - 1) / chunks, br0 = chunk * per_chunk;                    \
    const int64_t br1 = br0 + per_chunk < block_rows ? br0 + per_chunk : block_rows;                          \
    if (rows <= 0 || br0 >= br1) return 0;                                                                    \
    const int64_t used = used_rows(m, row0, tile);                                                              \
    const float *xt = x + tile_index * k * tile; /* the tile as the rows loop wrote it */                       \
    if (RV == 1 && used == tile) TILE_FN(TILE_1, 1, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else if (RV == 1) TILE_FN(QUARTER_1, 1, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else if (RV == 2 && used == tile) TILE_FN(TILE_2, 2, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else if (RV == 2) TILE_FN(QUARTER_2, 2, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else if (RV == 4 && used == tile) TILE_FN(TILE_4, 4, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else if (RV == 4) TILE_FN(QUARTER_4, 4, STORAGE)(out, n, row0, rows, xt, data, scales, offsets, indptr, cols, br0, br1); \
    else return -1; /* a block height the Python side does not build for */                                  \
    return 0;                                                                                                 \
  }
DEFINE_TASK(0)
DEFINE_TASK(1)
DEFINE_TASK(2)

/* out[M][N] (row stride N), x: the rows loop's transposed tiles; data: the blocks as [nnz][C][R]; offsets[j]: block j's first k;
   indptr[N / R + 1]; scales[N]: the int8 weights' per-row scales (i8w only). */
int32_t SYMBOL(f32)(float *out, const float *x, int32_t m, int32_t k, int32_t n, const float *data,
                    const int32_t *offsets, const int32_t *indptr, int32_t rows_per_block, int32_t cols,
                    int32_t tile_index, int32_t chunk, int32_t chunks) {
  return task_0(out, x, m, k, n, data, NULL, offsets, indptr, rows_per_block, cols, tile_index, chunk, chunks);
}

int32_t SYMBOL(bf16w)(float *out, const float *x, int32_t m, int32_t k, int32_t n, const uint16_t *data,
                      const int32_t *offsets, const int32_t *indptr, int32_t rows_per_block, int32_t cols,
                      int32_t tile_index, int32_t chunk, int32_t chunks) {
  return task_1(out, x, m, k, n, data, NULL, offsets, indptr, rows_per_block, cols, tile_index, chunk, chunks);
}

int32_t SYMBOL(i8w)(float *out, const float *x, int32_t m, int32_t k, int32_t n, const int8_t *data,
                    const float *scales, const int32_t *offsets, const int32_t *indptr, int32_t rows_per_block,
                    int32_t cols, int32_t tile_index, int32_t chunk, int32_t chunks) {
  return task_2(out, x, m, k, n, data, scales, offsets, indptr, rows_per_block, cols, tile_index, chunk, chunks);
}

#else
#if !defined(__AVX512VNNI__) || BERT_LANES != 16
#error "the vnni kernel needs AVX512_VNNI and BERT_LANES 16"
#endif
#define VNNI_TILE 16 /* rows: 16 zmm accumulators, one block of 16 x 4 int8 in one zmm */

/* The first loop: tile `tile_index` of x[M][K] quantised onto u8 (per row: its range with 0 in it onto
   0..255, a zero point), 4 consecutive k of a row in one int32, transposed: xq[k / 4][row], 16 rows per
   tile (k * 4 bytes), its rows' scales and zero points in xs, xz (16 per tile). */
int32_t bert_bsr_vnni_rows_v16(uint32_t *xq, float *xs, int32_t *xz, const float *x, int32_t m, int32_t k,
                               int32_t tile_index) {
  const int64_t row0 = tile_index * VNNI_TILE, rows = m - row0 < VNNI_TILE ? m - row0 : VNNI_TILE;
  uint32_t *tile_q = xq + tile_index * (k / 4) * VNNI_TILE;
  for (int64_t row = 0; row < VNNI_TILE; ++row) {
    const float *xr = x + (row0 + (row < rows ? row : 0)) * k;
    float lo = 0.0f, hi = 0.0f;
    for (int64_t kk = 0; kk < k; ++kk) {
      lo = xr[kk] < lo ? xr[kk] : lo;
      hi = xr[kk] > hi ? xr[kk] : hi;
    }
    float s = (hi - lo) / 255.0f;
    s = s > 0.0f ? s : 1.0f;
    const int32_t z = _mm_cvtss_si32(_mm_set_ss(-lo / s)); /* rounded to nearest */
    xs[tile_index * VNNI_TILE + row] = s;
    xz[tile_index * VNNI_TILE + row] = z;
    for (int64_t g = 0; g < k / 4; ++g) {
      uint32_t packed = 0;
      for (int i = 0; i < 4; ++i) {
        int32_t q = _mm_cvtss_si32(_mm_set_ss(xr[g * 4 + i] / s)) + z;
        q = q < 0 ? 0 : q > 255 ? 255 : q;
        packed |= (uint32_t)q << (8 * i);
      }
      tile_q[g * VNNI_TILE + row] = packed;
    }
  }
  return 0;
}

/* A task's rows (tile `tile_index`: rows row0 .. row0 + rows) and block rows [br0, br1) of 16 outputs (the
`chunk`-th of `chunks` ranges); nothing to do where rows <= 0 or br0 >= br1. */
typedef struct {
  int64_t row0, rows, br0, br1;
} VnniTask;

static inline VnniTask vnni_task(int64_t m, int64_t n, int64_t tile_index, int64_t chunk, int64_t chunks) {
  const int64_t block_rows = n / 16, row0 = tile_index * VNNI_TILE;
  const int64_t per_chunk = (block_rows + chunks - 1) / chunks, br0 = chunk * per_chunk;
  const VnniTask task = {row0, m - row0 < VNNI_TILE ? m - row0 : VNNI_TILE, br0,
                         br0 + per_chunk < block_rows ? br0 + per_chunk : block_rows};
  return task;
}

/* y[row0 + t][br * 16 + r] for the tile's rows: the int32 sums less each row's zero point times the stored
   codes' sum, scaled by the weight row's and the activation row's scales. */
static inline void write_back(float *out, int64_t n, int64_t row0, int64_t rows, int64_t br, const __m512i *acc,
                              const float *scales, const int32_t *colsum, const float *xs, const int32_t *xz) {
  const __m512 sw = _mm512_loadu_ps(scales + br * 16);
  const __m512i sums = _mm512_loadu_si512(colsum + br * 16);
#pragma GCC unroll 16
  for (int t = 0; t < VNNI_TILE; ++t) {
    if (t < rows) {
      __m512i exact = _mm512_sub_epi32(acc[t], _mm512_mullo_epi32(sums, _mm512_set1_epi32(xz[t])));
      __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sw, _mm512_set1_ps(xs[t])));
      _mm512_storeu_ps(out + (row0 + t) * n + br * 16, y);
    }
  }
}

/* data: [nnz][16][4] int8 (lane r: the block's 4 weights of output row r); colsum[N]: each row's sum of
   its stored int8 weights (for the zero point); scales[N] per output row. */
int32_t bert_bsr_vnni_v16(float *out, const uint32_t *xq, const float *xs_all, const int32_t *xz_all, int32_t m,
                          int32_t k, int32_t n, const int8_t *data, const float *scales, const int32_t *colsum,
                          const int32_t *offsets, const int32_t *indptr, int32_t tile_index, int32_t chunk,
                          int32_t chunks) {
  const VnniTask task = vnni_task(m, n, tile_index, chunk, chunks);
  const int64_t row0 = task.row0, rows = task.rows, br0 = task.br0, br1 = task.br1;
  if (rows <= 0 || br0 >= br1 || k % 4) return rows <= 0 || br0 >= br1 ? 0 : -1;
  const uint32_t *tile_q = xq + tile_index * (k / 4) * VNNI_TILE;
  const float *xs = xs_all + tile_index * VNNI_TILE;
  const int32_t *xz = xz_all + tile_index * VNNI_TILE;
  for (int64_t br = br0; br < br1; ++br) {
    __m512i acc[VNNI_TILE];
#pragma GCC unroll 16
    for (int t = 0; t < VNNI_TILE; ++t) acc[t] = _mm512_setzero_si512();
    for (int64_t j = indptr[br]; j < indptr[br + 1]; ++j) {
      _mm_prefetch((const char *)(data + (j + PREFETCH_BLOCKS) * 64), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(data + j * 64);
      const uint32_t *column = tile_q + (offsets[j] / 4) * VNNI_TILE;
#pragma GCC unroll 16
      for (int t = 0; t < VNNI_TILE; ++t)
        acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32((int32_t)column[t]), w);
    }
    write_back(out, n, row0, rows, br, acc, scales, colsum, xs, xz);
  }
  return 0;
}

/* vnni_gather: a weight pruned in 16 x 1 blocks, each block row's blocks taken in fours whatever their k
   (the last four padded with zero blocks): a four is one zmm (lane r: output row r's 4 weights), its 4 k
   in `offsets`. The tile's activations are quantised as for vnni but stored a k per 16-byte line (the 16
   rows' codes of that k), so a four's activations are 4 line loads interleaved into 16 rows' quads: 8
   shuffles per 16 `vpdpbusd`, where FMA kernels spend 64 FMAs on the same four blocks. */

/* 16 rows of 16 bytes transposed in place: four rounds of pairing row i with row i + 8. */
static inline void transpose_16x16(__m128i r[16]) {
#pragma GCC unroll 4
  for (int round = 0; round < 4; ++round) {
    __m128i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]);
      t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
}

/* The first loop: tile `tile_index` of x[M][K] (K a multiple of 16) quantised onto u8 as vnni's rows, stored
   as K lines of the 16 rows' codes (K * 16 bytes per tile). */
int32_t bert_bsr_vnni_gather_rows_v16(uint8_t *xq, float *xs_all, int32_t *xz_all, const float *x, int32_t m,
                                      int32_t k, int32_t tile_index) {
  const int64_t row0 = tile_index * VNNI_TILE, rows = m - row0 < VNNI_TILE ? m - row0 : VNNI_TILE;
  uint8_t *tile_q = xq + tile_index * (int64_t)k * VNNI_TILE;
  float *xs = xs_all + tile_index * VNNI_TILE;
  int32_t *xz = xz_all + tile_index * VNNI_TILE;
  const float *xr[VNNI_TILE];
  for (int64_t row = 0; row < VNNI_TILE; ++row) {
    xr[row] = x + (row0 + (row < rows ? row : 0)) * k;
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 16) {
      const __m512 v = _mm512_loadu_ps(xr[row] + kk);
      lo = _mm512_min_ps(lo, v);
      hi = _mm512_max_ps(hi, v);
    }
    const float l = _mm512_reduce_min_ps(lo), h = _mm512_reduce_max_ps(hi);
    const float s = h > l ? (h - l) / 255.0f : 1.0f;
    xs[row] = s;
    xz[row] = _mm_cvtss_si32(_mm_set_ss(-l / s)); /* rounded to nearest */
  }
  const __m512i low = _mm512_setzero_si512(), high = _mm512_set1_epi32(255);
  for (int64_t kc = 0; kc < k; kc += 16) {
    __m128i lines[VNNI_TILE];
#pragma GCC unroll 16
    for (int row = 0; row < VNNI_TILE; ++row) {
      __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr[row] + kc), _mm512_set1_ps(xs[row])));
      q = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(xz[row])), low), high);
      lines[row] = _mm512_cvtepi32_epi8(q);
    }
    transpose_16x16(lines);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm_storeu_si128((__m128i *)(tile_q + (kc + i) * VNNI_TILE), lines[i]);
  }
  return 0;
}

/* data: [fours][16][4] int8; offsets: [fours][4], each block's k; indptr: each block row's first four. */
int32_t bert_bsr_vnni_gather_v16(float *out, const uint8_t *xq, const float *xs_all, const int32_t *xz_all,
                                 int32_t m, int32_t k, int32_t n, const int8_t *data, const float *scales,
                                 const int32_t *colsum, const int32_t *offsets, const int32_t *indptr,
                                 int32_t tile_index, int32_t chunk, int32_t chunks) {
  const VnniTask task = vnni_task(m, n, tile_index, chunk, chunks);
  const int64_t row0 = task.row0, rows = task.rows, br0 = task.br0, br1 = task.br1;
  if (rows <= 0 || br0 >= br1) return 0;
  const uint8_t *tile_q = xq + tile_index * (int64_t)k * VNNI_TILE;
  const float *xs = xs_all + tile_index * VNNI_TILE;
  const int32_t *xz = xz_all + tile_index * VNNI_TILE;
  uint32_t quads[VNNI_TILE] __attribute__((aligned(64)));
  for (int64_t br = br0; br < br1; ++br) {
    __m512i acc[VNNI_TILE];
#pragma GCC unroll 16
    for (int t = 0; t < VNNI_TILE; ++t) acc[t] = _mm512_setzero_si512();
    for (int64_t j = indptr[br]; j < indptr[br + 1]; ++j) {
      _mm_prefetch((const char *)(data + (j + PREFETCH_BLOCKS) * 64), _MM_HINT_T0);
      const int32_t *at = offsets + 4 * j;
      const __m128i l0 = _mm_loadu_si128((const __m128i *)(tile_q + (int64_t)at[0] * VNNI_TILE));
      const __m128i l1 = _mm_loadu_si128((const __m128i *)(tile_q + (int64_t)at[1] * VNNI_TILE));
      const __m128i l2 = _mm_loadu_si128((const __m128i *)(tile_q + (int64_t)at[2] * VNNI_TILE));
      const __m128i l3 = _mm_loadu_si128((const __m128i *)(tile_q + (int64_t)at[3] * VNNI_TILE));
      const __m128i a_lo = _mm_unpacklo_epi8(l0, l1), a_hi = _mm_unpackhi_epi8(l0, l1);
      const __m128i b_lo = _mm_unpacklo_epi8(l2, l3), b_hi = _mm_unpackhi_epi8(l2, l3);
      _mm_store_si128((__m128i *)quads, _mm_unpacklo_epi16(a_lo, b_lo));
      _mm_store_si128((__m128i *)quads + 1, _mm_unpackhi_epi16(a_lo, b_lo));
      _mm_store_si128((__m128i *)quads + 2, _mm_unpacklo_epi16(a_hi, b_hi));
      _mm_store_si128((__m128i *)quads + 3, _mm_unpackhi_epi16(a_hi, b_hi));
      const __m512i w = _mm512_loadu_si512(data + j * 64);
#pragma GCC unroll 16
      for (int t = 0; t < VNNI_TILE; ++t) acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32((int32_t)quads[t]), w);
    }
    write_back(out, n, row0, rows, br, acc, scales, colsum, xs, xz);
  }
  return 0;
}
#endif
