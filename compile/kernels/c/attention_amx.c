/* Attention's two products on AMX tiles (`tdpbf16ps`, compile/kernels/attention_amx.py), around the bf16
   attention's softmax (attention_bf16.c). */
#include "amx.h"

/* dst[c][r] (row stride `stride`) = src[r][c] (row stride cols) rounded to bf16 (nearest even), for
   r < rows (a multiple of 16) and c < cols. */
int32_t bert_bf16_transpose_round(uint16_t *dst, const float *src, int64_t rows, int64_t cols, int64_t stride) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int32_t)cols));
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < cols; ++c)
      _mm256_storeu_si256((__m256i *)(dst + c * stride + r),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_i32gather_ps(index, src + r * cols + c, 4)));
  return 0;
}

/* One block of 16 keys into accumulator tile G: its key tiles are KA (dims 0-31 and 64-95) and KB (32-63 and
   96-127), the query tiles 4-7 (dims 0-31, 32-63, ...). */
#define AMX_SCORE_BLOCK(HEAD, G, KA, KB, b)     \
  if ((b) < blocks) {                           \
    const uint16_t *k = keys + (b) * 16 * HEAD; \
    _tile_zero(G);                              \
    _tile_loadd(KA, k, HEAD * 2);               \
    _tile_dpbf16ps(G, KA, 4);                   \
    if (HEAD > 32) {                            \
      _tile_loadd(KB, k + 32, HEAD * 2);        \
      _tile_dpbf16ps(G, KB, 5);                 \
    }                                           \
    if (HEAD > 64) {                            \
      _tile_loadd(KA, k + 64, HEAD * 2);        \
      _tile_dpbf16ps(G, KA, 6);                 \
      _tile_loadd(KB, k + 96, HEAD * 2);        \
      _tile_dpbf16ps(G, KB, 7);                 \
    }                                           \
  }
/* Key j's stored scores plus its bias (and the queries' score biases, where tile_bias is not NULL), and each
   query's largest so far. */
#define AMX_SCORE_ROW(j)                                                                   \
  {                                                                                        \
    __m512 s = _mm512_add_ps(_mm512_loadu_ps(scores + (j) * 16), _mm512_set1_ps(bias[j])); \
    if (tile_bias) s = _mm512_add_ps(s, _mm512_loadu_ps(tile_bias + (j) * 16));            \
    _mm512_storeu_ps(scores + (j) * 16, s);                                                \
    largest = _mm512_max_ps(largest, s);                                                   \
  }

/* scores[j][16] = keys[j][HEAD] x queries[HEAD / 2][16][2] + bias[j] for the keys j < length (16 keys a tile
   product; keys staged to a multiple of 32 rows); top[16]: each query's largest score. A product's sums are
   ready some 50 cycles after it starts and the next product into the same tile waits for them, so ACCS
   blocks run at once, each in its own accumulator (4; 2 at a head of 128, whose queries take 4 tiles; the
   even blocks' key tiles A0 / B0, the odd ones' A1 / B1), and the bias and largest score of a group's rows
   are taken while the next group's products run (a vector load of rows a tile store has just written
   waits for the store). Against one block at a time, in a C loop over L1-resident operands (heads 32-128):
   0.62-0.80x the time of 512 keys' scores, 0.86-0.91x with the softmax and context products of a query tile;
   whole 12 x 768 BERT calls took 0.98-1.01x the time, within this machine's noise
   (docs/experiments/amx-attention-scores.md). */
#define AMX_SCORES(HEAD, A0, B0, A1, B1)                                                                  \
  int32_t bert_amx_attention_scores_d##HEAD(float *scores, float *top, const uint16_t *keys,              \
                                            const uint16_t *queries, const float *bias,                   \
                                            const float *tile_bias, int64_t length) {                     \
    enum { STEPS = HEAD / 32, ACCS = STEPS > 2 ? 2 : 4 };                                                 \
    const int64_t blocks = (length + 15) / 16;                                                            \
    __m512 largest = _mm512_set1_ps(-__FLT_MAX__);                                                        \
    int64_t done = 0;                                                                                     \
    bert_amx_configure();                                                                                 \
    _tile_loadd(4, queries, 64);                                                                          \
    if (STEPS > 1) _tile_loadd(5, queries + 512, 64);                                                     \
    if (STEPS > 2) {                                                                                      \
      _tile_loadd(6, queries + 1024, 64);                                                                 \
      _tile_loadd(7, queries + 1536, 64);                                                                 \
    }                                                                                                     \
    for (int64_t group = 0; group < blocks; group += ACCS) {                                              \
      AMX_SCORE_BLOCK(HEAD, 0, A0, B0, group)                                                             \
      AMX_SCORE_BLOCK(HEAD, 1, A1, B1, group + 1)                                                         \
      if (ACCS > 2) {                                                                                     \
        AMX_SCORE_BLOCK(HEAD, 2, A0, B0, group + 2)                                                       \
        AMX_SCORE_BLOCK(HEAD, 3, A1, B1, group + 3)                                                       \
      }                                                                                                   \
      for (; done < group * 16 && done < length; ++done) AMX_SCORE_ROW(done)                              \
      _tile_stored(0, scores + group * 256, 64);                                                          \
      if (group + 1 < blocks) _tile_stored(1, scores + (group + 1) * 256, 64);                            \
      if (ACCS > 2 && group + 2 < blocks) _tile_stored(2, scores + (group + 2) * 256, 64);                \
      if (ACCS > 2 && group + 3 < blocks) _tile_stored(3, scores + (group + 3) * 256, 64);                \
    }                                                                                                     \
    for (; done < length; ++done) AMX_SCORE_ROW(done)                                                     \
    _mm512_storeu_ps(top, largest);                                                                       \
    return 0;                                                                                             \
  }

/* context[16][HEAD] = probs[pairs][16][2] x values, given as values_t[HEAD][stride] (V^T, bf16, zero past the last
   key up to a multiple of 32); probs' pairs past `pairs` are zeroed up to a multiple of 16 first. */
#define AMX_CONTEXT(HEAD)                                                                               \
  int32_t bert_amx_attention_context_d##HEAD(float *context, uint16_t *probs, const uint16_t *values_t, \
                                             int64_t stride, int64_t pairs) {                           \
    enum { BLOCKS = HEAD / 16, PASS = BLOCKS < 4 ? BLOCKS : 4 };                                        \
    const int64_t steps = (pairs + 15) / 16;                                                            \
    memset(probs + pairs * 32, 0, (size_t)(steps * 16 - pairs) * 64);                                   \
    float sums[PASS][16][16];                                                                           \
    bert_amx_configure();                                                                               \
    for (int pass = 0; pass < BLOCKS; pass += PASS) {                                                   \
      const uint16_t *v = values_t + pass * 16 * stride;                                                \
      _tile_zero(0);                                                                                    \
      _tile_zero(1);                                                                                    \
      if (PASS > 2) {                                                                                   \
        _tile_zero(2);                                                                                  \
        _tile_zero(3);                                                                                  \
      }                                                                                                 \
      for (int64_t s = 0; s < steps; ++s) {                                                             \
        _tile_loadd(7, probs + s * 512, 64);                                                            \
        _tile_loadd(4, v + s * 32, stride * 2);                                                         \
        _tile_dpbf16ps(0, 4, 7);                                                                        \
        _tile_loadd(5, v + 16 * stride + s * 32, stride * 2);                                           \
        _tile_dpbf16ps(1, 5, 7);                                                                        \
        if (PASS > 2) {                                                                                 \
          _tile_loadd(4, v + 32 * stride + s * 32, stride * 2);                                         \
          _tile_dpbf16ps(2, 4, 7);                                                                      \
          _tile_loadd(5, v + 48 * stride + s * 32, stride * 2);                                         \
          _tile_dpbf16ps(3, 5, 7);                                                                      \
        }                                                                                               \
      }                                                                                                 \
      _tile_stored(0, sums[0], 64);                                                                     \
      _tile_stored(1, sums[1], 64);                                                                     \
      if (PASS > 2) {                                                                                   \
        _tile_stored(2, sums[2], 64);                                                                   \
        _tile_stored(3, sums[3], 64);                                                                   \
      }                                                                                                 \
      for (int b = 0; b < PASS; ++b)                                                                    \
        for (int d = 0; d < 16; ++d)                                                                    \
          for (int q = 0; q < 16; ++q) context[q * HEAD + (pass + b) * 16 + d] = sums[b][d][q];         \
    }                                                                                                   \
    return 0;                                                                                           \
  }

AMX_SCORES(32, 5, 5, 6, 6) AMX_SCORES(64, 6, 7, 6, 7) AMX_SCORES(128, 2, 3, 2, 3)
AMX_CONTEXT(32) AMX_CONTEXT(64) AMX_CONTEXT(128)
