/* Attention's two products and the softmax between them in bf16 (AVX512_BF16 `vdpbf16ps`,
   compile/kernels/attention_bf16.py), with the rounding of their operands. The products are specialised per
   head size (16, 32, 64, 128): their register tiles are compile-time shapes. */
#include "kernels.h"
#include "exp.h"
/* dst[n] = src[n] rounded to bf16 (nearest even); n % 16 == 0. */
int32_t bert_bf16_round(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  return 0;
}

/* even[0], odd[0], even[1], odd[1], ...: two rows' 16 values each, rounded to bf16 (nearest even) and
   interleaved into pairs. */
static inline __m512i bert_bf16_pairs(__m512 even, __m512 odd) {
  static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even in the low half, odd in the high */
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), halves);
}

/* dst[pairs][cols][2] = rows 2p and 2p + 1 of src[2 * pairs][cols], interleaved and rounded to bf16
   (nearest even); cols % 16 == 0. */
int32_t bert_bf16_pair_rows(uint16_t *dst, const float *src, int64_t pairs, int64_t cols) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t c = 0; c < cols; c += 16)
      _mm512_storeu_si512(dst + 2 * (p * cols + c), bert_bf16_pairs(_mm512_loadu_ps(src + 2 * p * cols + c),
                                                                    _mm512_loadu_ps(src + (2 * p + 1) * cols + c)));
  return 0;
}

/* out[c * 16 + r] = in[r * 16 + c] for a 16 x 16 block of 32-bit words, the first `rows` rows of out
   written: four rounds of unpacks and lane shuffles in registers. */
static inline void bert_transpose_16x16(float *out, const float *in, int64_t rows) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
  for (int i = 0; i < rows; ++i) _mm512_storeu_ps(out + 16 * i, r[i]);
}

/* dst[head / 2][16][2] = the dim pairs of 16 queries, the rows src + offsets[q] (head floats each) times
   scale, rounded to bf16 (nearest even; the pairs bert_bf16_pair_rows makes of the transposed copy). Each
   row is read whole, its dims rounded in order (so each 32-bit word is one dim pair), and the 16 rows'
   words transposed in registers, 16 pairs a block: a transposed copy in TIR was a vector scatter per
   query and 8 dims, half the attention kernel's own time at 512 tokens (`perf record`). */
int32_t bert_bf16_query_pairs(float *dst, const float *src, const int64_t *offsets, float scale, int64_t head) {
  const __m512 s = _mm512_set1_ps(scale);
  float words[16][16];
  for (int64_t p0 = 0; p0 < head / 2; p0 += 16) {
    const int64_t pairs = head / 2 - p0 < 16 ? head / 2 - p0 : 16;
    for (int q = 0; q < 16; ++q) {
      const float *row = src + offsets[q] + 2 * p0;
      __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row), s);
      __m512 hi = pairs > 8 ? _mm512_mul_ps(_mm512_loadu_ps(row + 16), s) : _mm512_setzero_ps();
      _mm512_storeu_si512(words[q], (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* lo's dims in the low half */
    }
    bert_transpose_16x16(dst + p0 * 16, words[0], pairs);
  }
  return 0;
}

/* The bf16 pair at p broadcast to every 32-bit lane, straight from memory (vbroadcastss). */
typedef float bert_pair_word __attribute__((may_alias, aligned(2)));
#define PAIR_AT(p) ((__m512bh)_mm512_castps_si512(_mm512_set1_ps(*(const bert_pair_word *)(p))))

/* scores[j][16] = keys[j][HEAD] x queries[HEAD / 2][16][2] + bias[j] (+ tile_bias[j][16], each query's own
   score bias, where not NULL) for the keys j < length, 8 keys x 16 queries a tile (one broadcast dim pair of a
   key times one register of the queries' pairs per instruction); top[16]: each query's largest score. */
#define SCORES(HEAD)                                                                                       \
  int32_t bert_bf16_attention_scores_d##HEAD(float *scores, float *top, const uint16_t *keys,              \
                                             const uint16_t *queries, const float *bias,                   \
                                             const float *tile_bias, int64_t length) {                     \
    __m512 largest = _mm512_set1_ps(-__FLT_MAX__);                                                         \
    for (int64_t block = 0; block < (length + 7) / 8; ++block) {                                           \
      const uint16_t *k = keys + block * 8 * HEAD;                                                         \
      __m512 acc[8];                                                                                       \
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();                    \
      _Pragma("GCC unroll 2") for (int p = 0; p < HEAD / 2; ++p) {                                         \
        __m512bh q = (__m512bh)_mm512_loadu_si512(queries + 32 * p);                                       \
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i)                                                \
          acc[i] = _mm512_dpbf16_ps(acc[i], PAIR_AT(k + i * HEAD + 2 * p), q);                             \
      }                                                                                                    \
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {                                                \
        int64_t j = block * 8 + i;                                                                         \
        if (j < length) {                                                                                  \
          __m512 s = _mm512_add_ps(acc[i], _mm512_set1_ps(bias[j]));                                       \
          if (tile_bias) s = _mm512_add_ps(s, _mm512_loadu_ps(tile_bias + j * 16));                        \
          _mm512_storeu_ps(scores + j * 16, s);                                                            \
          largest = _mm512_max_ps(largest, s);                                                             \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    _mm512_storeu_ps(top, largest);                                                                        \
    return 0;                                                                                              \
  }

/* exp(x) for x <= 0, to the precision of what it feeds: 2^n x p(r), n = round(x / ln 2) (the 1.5 x 2^23
   shift rounds to nearest in one add), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], p a degree-3 minimax
   polynomial (relative error 7.5e-5; the probabilities are then rounded to bf16, whose steps are 2^-8).
   Cephes' degree-5 form took twice the instructions, and the softmax was a fifth of an int8 MiniLM
   call's library time at 512 tokens (`perf record` of repeated calls), bound by the vector ports. */
static inline __m512 bert_exp(__m512 x) {
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  x = _mm512_max_ps(x, _mm512_set1_ps(BERT_EXP_FLOOR));
  __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(BERT_EXP_LOG2E), shift), shift);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(BERT_EXP_LN2), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(BERT_EXP_P3), r, _mm512_set1_ps(BERT_EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BERT_EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BERT_EXP_P0));
  return _mm512_scalef_ps(p, n);
}

/* probs[(length + 1) / 2][16][2] = exp(scores[j][16] - top) rounded to bf16 (nearest even), in key pairs (an odd
   length's last partner 0); total[16] = each query's sum of the unrounded exps. */
int32_t bert_bf16_softmax_pairs(uint16_t *probs, float *total, const float *scores, const float *top, int64_t length) {
  const __m512 largest = _mm512_loadu_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t p = 0; p < (length + 1) / 2; ++p) {
    __m512 even = bert_exp(_mm512_sub_ps(_mm512_loadu_ps(scores + 32 * p), largest));
    __m512 odd = 2 * p + 1 < length ? bert_exp(_mm512_sub_ps(_mm512_loadu_ps(scores + 32 * p + 16), largest))
                                    : _mm512_setzero_ps();
    sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
    _mm512_storeu_si512(probs + 32 * p, bert_bf16_pairs(even, odd));
  }
  _mm512_storeu_ps(total, sum);
  return 0;
}

/* context[16][HEAD] = probs[pairs][16][2] x values[pairs][HEAD][2]: QP queries' whole head rows a pass
   (16 accumulators), one broadcast probability pair of a query times one register of value pairs. */
#define CONTEXT(HEAD)                                                                                            \
  int32_t bert_bf16_attention_context_d##HEAD(float *context, const uint16_t *probs, const uint16_t *values,     \
                                              int64_t pairs) {                                                   \
    enum { DV = HEAD / 16, QP = 16 / DV };                                                                       \
    for (int part = 0; part < 16 / QP; ++part) {                                                                 \
      __m512 acc[QP][DV];                                                                                        \
      _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q)                                                      \
        _Pragma("GCC unroll 8") for (int d = 0; d < DV; ++d) acc[q][d] = _mm512_setzero_ps();                    \
      for (int64_t p = 0; p < pairs; ++p) {                                                                      \
        __m512bh v[DV];                                                                                          \
        _Pragma("GCC unroll 8") for (int d = 0; d < DV; ++d)                                                     \
          v[d] = (__m512bh)_mm512_loadu_si512(values + (p * HEAD + 16 * d) * 2);                                 \
        _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q) {                                                  \
          __m512bh w = PAIR_AT(probs + (p * 16 + part * QP + q) * 2);                                            \
          _Pragma("GCC unroll 8") for (int d = 0; d < DV; ++d) acc[q][d] = _mm512_dpbf16_ps(acc[q][d], w, v[d]); \
        }                                                                                                        \
      }                                                                                                          \
      _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q)                                                      \
        _Pragma("GCC unroll 8") for (int d = 0; d < DV; ++d)                                                     \
          _mm512_storeu_ps(context + (part * QP + q) * HEAD + 16 * d, acc[q][d]);                                \
    }                                                                                                            \
    return 0;                                                                                                    \
  }

SCORES(16) SCORES(32) SCORES(64) SCORES(128)
CONTEXT(16) CONTEXT(32) CONTEXT(64) CONTEXT(128)
