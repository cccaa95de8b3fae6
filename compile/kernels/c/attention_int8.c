/* Attention's two products in int8 (compile/kernels/attention_int8.py): u8 x s8 products summed in int32, on
   ymm (BERT_LANES 8: AVX2 `vpmaddubsw` + `vpmaddwd`) or zmm (BERT_LANES 16: AVX512BW, `vpdpbusd` where the CPU
   has AVX512_VNNI), with the quantisation of their operands. The products are specialised per head size (16,
   32, 64, 128). */
#include "kernels.h"
#include "exp.h"

#if !defined(BERT_PAIR_CODES) || !defined(BERT_CODES) || !defined(BERT_LOG_PROBABILITY_CODES) || \
    !defined(BERT_QUERY_OFFSET)
#error "the int8 codes' constants are passed with -D (compile/kernels/attention_int8.py)"
#endif
#if BERT_LANES == 16
#ifndef __AVX512BW__
#error "BERT_LANES 16 (zmm) needs AVX512BW"
#endif
#elif BERT_LANES == 8
#ifndef __AVX2__
#error "BERT_LANES 8 (ymm) needs AVX2"
#endif
#else
#error "BERT_LANES is 8 (ymm) or 16 (zmm)"
#endif

static inline float bert_hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* max(largest |a|, largest same-sign sum of the pairs (a[i], b[i])), lane by lane. */
static inline __m256 bert_pair_bound(__m256 bound, __m256 a, __m256 b) {
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  __m256 positive = _mm256_add_ps(_mm256_max_ps(a, zero), _mm256_max_ps(b, zero));
  __m256 negative = _mm256_add_ps(_mm256_min_ps(a, zero), _mm256_min_ps(b, zero));
  __m256 single = _mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b));
  return _mm256_max_ps(bound, _mm256_max_ps(_mm256_max_ps(positive, _mm256_andnot_ps(sign, negative)), single));
}

/* The steps that put values of 8 bounds onto s8 codes whose same-sign pairs sum to at most BERT_PAIR_CODES
   after rounding: each bound onto BERT_CODES (rounding adds at most one code to a pair), 1 for a bound of 0.
   Eight at a time: a division's latency, paid per row, cost as much as a short row's codes. */
static inline __m256 bert_steps8(__m256 bound) {
  return _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(bound, _mm256_set1_ps(BERT_CODES)),
                          _mm256_cmp_ps(bound, _mm256_setzero_ps(), _CMP_GT_OQ));
}

/* The staging below is on ymm at either width. */
#define BERT_BITS 256
#include "int8_width.h"
#undef BERT_BITS

/* 16 int32 codes (a, then b), each in -128..255, as 16 bytes in order. */
static inline void bert_store_bytes(void *dst, __m256i a, __m256i b, int unsigned_codes) {
  __m256i halves = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
  __m256i bytes = unsigned_codes ? _mm256_packus_epi16(halves, halves) : _mm256_packs_epi16(halves, halves);
  _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(_mm256_permute4x64_epi64(bytes, 0x08)));
}

/* A key's bound: bert_pair_bound over its pairs of dims 2i and 2i + 1, 8 pairs a step. */
static inline float bert_key_bound(const float *row, int64_t head) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 bound = _mm256_setzero_ps();
  for (int64_t d = 0; d < head; d += 16) {
    __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(row + d), even);
    __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(row + d + 8), even);
    bound = bert_pair_bound(bound, _mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  return bert_hmax(bound);
}

/* codes[count][head] = keys[count][head] in s8, pair-bounded per key (scales[j]); init[j] = -128 x the
   key's sum of codes, where its accumulator starts (the queries' u8 offset taken out). head % 16 == 0. */
int32_t bert_int8_stage_keys(int8_t *codes, int32_t *init, float *scales, const float *keys, int64_t count,
                             int64_t head) {
  for (int64_t first = 0; first < count; first += 8) {  /* 8 keys a block: their steps' divisions at once */
    const int64_t n = count - first < 8 ? count - first : 8;
    float bounds[8] = {0}, steps[8], inverses[8];
    for (int64_t i = 0; i < n; ++i)
      bounds[i] = bert_key_bound(keys + (first + i) * head, head);
    const __m256 step = bert_steps8(_mm256_loadu_ps(bounds));
    _mm256_storeu_ps(steps, step);
    _mm256_storeu_ps(inverses, _mm256_div_ps(_mm256_set1_ps(1.0f), step));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = first + i;
      const float *row = keys + j * head;
      const __m256 inverse = _mm256_set1_ps(inverses[i]);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t d = 0; d < head; d += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + d), inverse));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + d + 8), inverse));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
        bert_store_bytes(codes + j * head + d, a, b, 0);
      }
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s = _mm_hadd_epi32(s, s);
      s = _mm_hadd_epi32(s, s);
      scales[j] = steps[i];
      init[j] = -BERT_QUERY_OFFSET * _mm_cvtsi128_si32(s);
    }
  }
  return 0;
}

/* codes[count / 4][head][4] = values[count][head] in s8, pair-bounded per head dim over the key pairs
   (scales[d]); count % 4 == 0, head % 8 == 0. */
int32_t bert_int8_stage_values(int8_t *codes, float *scales, const float *values, int64_t count, int64_t head) {
  for (int64_t d = 0; d < head; d += 8) {
    __m256 bound = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j += 2)
      bound = bert_pair_bound(bound, _mm256_loadu_ps(values + j * head + d),
                              _mm256_loadu_ps(values + (j + 1) * head + d));
    const __m256 step = bert_steps8(bound);
    _mm256_storeu_ps(scales + d, step);
    const __m256 inverse = _mm256_div_ps(_mm256_set1_ps(1.0f), step);
    for (int64_t j = 0; j < count; j += 4) {
      __m256i c[4];
      for (int i = 0; i < 4; ++i)
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(values + (j + i) * head + d), inverse));
      _mm256_storeu_si256((__m256i *)(codes + ((j / 4) * head + d) * 4), bert_quad_words8(c[0], c[1], c[2], c[3]));
    }
  }
  return 0;
}

/* dst[head / 4][16][4] = the u8 codes of 16 queries, the rows src + offsets[q] (head floats each) times
   `scale`, each symmetric onto -BERT_CODES..BERT_CODES (scales[q]) plus BERT_QUERY_OFFSET. head % 16 == 0. */
int32_t bert_int8_query_quads(uint8_t *dst, float *scales, const float *src, const int64_t *offsets, float scale,
                              int64_t head) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i offset = _mm256_set1_epi32(BERT_QUERY_OFFSET);
  uint32_t words[32];
  float bounds[16], inverses[16];
  for (int q = 0; q < 16; ++q) {
    __m256 largest = _mm256_setzero_ps();
    for (int64_t d = 0; d < head; d += 8)
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + offsets[q] + d)));
    bounds[q] = bert_hmax(largest) * scale;
  }
  for (int q = 0; q < 16; q += 8) {
    const __m256 step = bert_steps8(_mm256_loadu_ps(bounds + q));
    _mm256_storeu_ps(scales + q, step);
    _mm256_storeu_ps(inverses + q, _mm256_div_ps(_mm256_set1_ps(scale), step));
  }
  for (int q = 0; q < 16; ++q) {
    const float *row = src + offsets[q];
    const __m256 inverse = _mm256_set1_ps(inverses[q]);
    for (int64_t d = 0; d < head; d += 128) {  /* 32 quads a block */
      const int64_t n = head - d < 128 ? head - d : 128;
      for (int64_t e = 0; e < n; e += 16) {
        const float *x = row + d + e;
        __m256i a = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inverse)), offset);
        __m256i b = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inverse)), offset);
        bert_store_bytes(words + e / 4, a, b, 1);
      }
      for (int64_t t = 0; t < n / 4; ++t) memcpy(dst + ((d / 4 + t) * 16 + q) * 4, words + t, 4);
    }
  }
  return 0;
}

#if BERT_LANES == 16
#define BERT_BITS 512
#include "int8_width.h"
#undef BERT_BITS

/* keys first .. first + N - 1 against the tile's queries: their scores written and the running max. */
static inline __attribute__((always_inline)) __m512 bert_score_block16(
    float *scores, const uint8_t *queries, const int8_t *keys, const int32_t *key_init, const float *key_scales,
    const float *bias, const float *tile_bias, __m512 scale, __m512 top, int64_t first, int64_t length, const int N,
    const int head) {
  __m512i acc[16];
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_epi32(key_init[first + i]);
  const int8_t *k = keys + first * head;
  for (int t = 0; t < head / 4; ++t) {
    __m512i q = _mm512_loadu_si512((const void *)(queries + 64 * t));
    _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i)
      acc[i] = bert_dot16(acc[i], q, bert_word_at16(k + i * head + 4 * t));
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < N; ++i) {
    int64_t j = first + i;
    __m512 s = _mm512_set1_ps(-__FLT_MAX__);  /* past the last key: a score whose probability code is 0 */
    if (j < length) {
      s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(scale, _mm512_set1_ps(key_scales[j])),
                          _mm512_set1_ps(bias[j]));
      if (tile_bias) s = _mm512_add_ps(s, _mm512_loadu_ps(tile_bias + 16 * j));
      top = _mm512_max_ps(top, s);
    }
    _mm512_storeu_ps(scores + 16 * j, s);
  }
  return top;
}

/* The same tile on zmm registers (AVX512BW; `vpdpbusd` where the CPU has AVX512_VNNI): one register is the
   tile's 16 queries. The scores take 16 keys a block (then 4), each key's broadcast quad folded into its
   product; the context 16 accumulators, QP queries x DP registers of 16 dims a pass. */
#define TILE(HEAD)                                                                                               \
  int32_t bert_int8_attention_d##HEAD(float *context, const uint8_t *queries, const float *query_scales,         \
                                      const int8_t *keys, const int32_t *key_init, const float *key_scales,      \
                                      const int8_t *values, const float *value_scales, const float *bias, const float *tile_bias,        \
                                      int64_t length, float *scores, uint32_t *probs) {                          \
    const __m512 scale = _mm512_loadu_ps(query_scales);                                                          \
    __m512 top = _mm512_set1_ps(-__FLT_MAX__);                                                                   \
    const int64_t staged = (length + 3) / 4 * 4;                                                                 \
    int64_t first = 0;                                                                                           \
    for (; first + 16 <= staged; first += 16)                                                                    \
      top = bert_score_block16(scores, queries, keys, key_init, key_scales, bias, tile_bias, scale, top, first, length, \
                               16, \
                               HEAD);                                                                            \
    for (; first < staged; first += 4)                                                                           \
      top = bert_score_block16(scores, queries, keys, key_init, key_scales, bias, tile_bias, scale, top, first, length, \
                               4, \
                               HEAD);                                                                            \
    top = _mm512_sub_ps(top, _mm512_set1_ps(BERT_LOG_PROBABILITY_CODES)); /* exp(s - top) x 255 */               \
    __m512i sum = _mm512_setzero_si512();                                                                        \
    for (int64_t p = 0; p < staged / 4; ++p) {                                                                   \
      __m512i c[4];                                                                                              \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                      \
        c[i] = _mm512_cvtps_epi32(bert_exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + 16 * (4 * p + i)), top)));   \
        sum = _mm512_add_epi32(sum, c[i]);                                                                       \
      }                                                                                                          \
      _mm512_storeu_si512((void *)(probs + 16 * p), bert_quad_words16(c[0], c[1], c[2], c[3]));                  \
    }                                                                                                            \
    float inverse[16];                                                                                           \
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(sum)));                     \
    bert_context16(context, probs, values, value_scales, inverse, staged / 4, HEAD);                             \
    return 0;                                                                                                    \
  }
#else
/* One tile of 16 queries: scores[j][16] = (keys[j] . queries) x the two scales + bias[j] (+ tile_bias[j][16],
   each query's own score bias, where not NULL) for the keys
   j < length (4 keys x 2 registers of queries a block), each query's largest; probs[j / 4][16] = the
   quads of exp(scores - largest) onto 0..255 (keys past `length` 0), with each query's sum of codes;
   context[16][HEAD] = probs x values x value_scales / that sum (QP queries x DP registers of dims a
   pass). */
#define TILE(HEAD)                                                                                                    \
  int32_t bert_int8_attention_d##HEAD(float *context, const uint8_t *queries, const float *query_scales,              \
                                      const int8_t *keys, const int32_t *key_init, const float *key_scales,           \
                                      const int8_t *values, const float *value_scales, const float *bias, const float *tile_bias,             \
                                      int64_t length, float *scores, uint32_t *probs) {                               \
    enum { QUADS = HEAD / 4 };                                                                                        \
    const __m256 scale_lo = _mm256_loadu_ps(query_scales), scale_hi = _mm256_loadu_ps(query_scales + 8);              \
    __m256 top_lo = _mm256_set1_ps(-__FLT_MAX__), top_hi = top_lo;                                                    \
    for (int64_t block = 0; block < (length + 3) / 4; ++block) {                                                      \
      __m256i lo[4], hi[4];                                                                                           \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm256_set1_epi32(key_init[4 * block + i]); \
      const int8_t *k = keys + 4 * block * HEAD;                                                                      \
      for (int t = 0; t < QUADS; ++t) {                                                                               \
        __m256i q_lo = _mm256_loadu_si256((const __m256i *)(queries + 64 * t));                                       \
        __m256i q_hi = _mm256_loadu_si256((const __m256i *)(queries + 64 * t + 32));                                  \
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                         \
          __m256i w = bert_word_at8(k + i * HEAD + 4 * t);                                                            \
          lo[i] = bert_dot8(lo[i], q_lo, w);                                                                          \
          hi[i] = bert_dot8(hi[i], q_hi, w);                                                                          \
        }                                                                                                             \
      }                                                                                                               \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                           \
        int64_t j = 4 * block + i;                                                                                    \
        if (j < length) {                                                                                             \
          __m256 ks = _mm256_set1_ps(key_scales[j]), b = _mm256_set1_ps(bias[j]);                                     \
          __m256 s_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), _mm256_mul_ps(scale_lo, ks), b);                   \
          __m256 s_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), _mm256_mul_ps(scale_hi, ks), b);                   \
          if (tile_bias) {                                                                                            \
            s_lo = _mm256_add_ps(s_lo, _mm256_loadu_ps(tile_bias + 16 * j));                                          \
            s_hi = _mm256_add_ps(s_hi, _mm256_loadu_ps(tile_bias + 16 * j + 8));                                      \
          }                                                                                                           \
          _mm256_storeu_ps(scores + 16 * j, s_lo);                                                                    \
          _mm256_storeu_ps(scores + 16 * j + 8, s_hi);                                                                \
          top_lo = _mm256_max_ps(top_lo, s_lo);                                                                       \
          top_hi = _mm256_max_ps(top_hi, s_hi);                                                                       \
        } else { /* past the last key: a score whose probability code is 0 */                                         \
          _mm256_storeu_ps(scores + 16 * j, _mm256_set1_ps(-__FLT_MAX__));                                            \
          _mm256_storeu_ps(scores + 16 * j + 8, _mm256_set1_ps(-__FLT_MAX__));                                        \
        }                                                                                                             \
      }                                                                                                               \
    }                                                                                                                 \
    /* exp(s - top) x 255 = exp(s - (top - ln 255)) */                                                                \
    const __m256 log_codes = _mm256_set1_ps(BERT_LOG_PROBABILITY_CODES);                                              \
    top_lo = _mm256_sub_ps(top_lo, log_codes);                                                                        \
    top_hi = _mm256_sub_ps(top_hi, log_codes);                                                                        \
    __m256i sum_lo = _mm256_setzero_si256(), sum_hi = sum_lo;                                                         \
    const int64_t quads = (length + 3) / 4;                                                                           \
    for (int64_t p = 0; p < quads; ++p) {                                                                             \
      __m256i c_lo[4], c_hi[4];                                                                                       \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                           \
        const float *s = scores + 16 * (4 * p + i);                                                                   \
        c_lo[i] = _mm256_cvtps_epi32(bert_exp8(_mm256_sub_ps(_mm256_loadu_ps(s), top_lo)));                           \
        c_hi[i] = _mm256_cvtps_epi32(bert_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8), top_hi)));                       \
        sum_lo = _mm256_add_epi32(sum_lo, c_lo[i]);                                                                   \
        sum_hi = _mm256_add_epi32(sum_hi, c_hi[i]);                                                                   \
      }                                                                                                               \
      _mm256_storeu_si256((__m256i *)(probs + 16 * p), bert_quad_words8(c_lo[0], c_lo[1], c_lo[2], c_lo[3]));         \
      _mm256_storeu_si256((__m256i *)(probs + 16 * p + 8), bert_quad_words8(c_hi[0], c_hi[1], c_hi[2], c_hi[3]));     \
    }                                                                                                                 \
    float inverse[16];                                                                                                \
    _mm256_storeu_ps(inverse, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(sum_lo)));                       \
    _mm256_storeu_ps(inverse + 8, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(sum_hi)));                   \
    bert_context8(context, probs, values, value_scales, inverse, quads, HEAD);                                        \
    return 0;                                                                                                         \
  }

#endif

TILE(16) TILE(32) TILE(64) TILE(128)
