"""Attention's two products in int8, for int8 libraries: `vpmaddubsw` + `vpmaddwd` on ymm (AVX2)
or zmm (AVX512BW), `vpdpbusd` on zmm where the CPU has AVX512_VNNI.

The fp32 kernel (attention.py) spends about 80% of its time in two products per (sequence, head)
and tile of 16 queries: scores = K Q^T over the head's dims, and context = P V over the keys.
Here both run as u8 x s8 products summed in int32, four multiply-adds per lane: at AVX2 three
instructions per 32 of them, where fp32 FMAs take four; with VNNI one per 64, where they take
four. The bias, the softmax's max and exp, and the normalisation stay in fp32.

The operands, each quantized once, as the int8 linears' are (kernels/int8.py):
- the tile's scaled queries per query, symmetric onto -127..127 and offset by 128 into u8 (the
  operand that must be unsigned), in dim quads `[dims / 4][16][4]`: one ymm is 8 queries' quads,
  one zmm 16. The offset's share, 128 x the key's sum of codes, starts each key's accumulator;
- the keys per key, s8, scaled so that no pair of same-sign codes in a quad sums past 128 (pairs
  of products are summed in saturating int16: `int8.PAIR_CODES`), broadcast one quad at a time;
- the probabilities exp(s - max) in [0, 1] onto 0..255 (a fixed step of 1/255: the largest is 1),
  in key quads per query `[keys / 4][16]` 32-bit words, broadcast against
- the values per head dim, s8 pair-bounded over the keys, in key quads `[keys / 4][dims][4]`.
Each query's context is divided by its sum of probability codes, the same rounded weights as the
product's. Accuracy: MiniLM's x86-64-v3 int8 library keeps least cosine 0.9922 to fp32 over the
shipped sentences, where with fp32 products it kept 0.9941, under the 0.99 gate the int8 plan
simulates it against (int8_simulation.Simulation).

Every instruction set computes the same codes and sums them exactly, so one simulation serves
all. On zmm the scores take 16 keys a block and the context 16 accumulators: `vpdpbusd`'s 5-cycle
latency wants at least 10 independent chains. With znver4's code on an AMX Xeon the zmm kernel
took 0.62-0.68x the fp32 kernel's time at MiniLM's and bert-base's heads (the compile's timing,
one sequence of 128 and of 512 tokens), and MiniLM's library kept least cosine 0.9943 on the
shipped sentences (0.9944 with fp32 products). The AVX-VNNI level (`--mcpu alderlake`) keeps the
ymm `vpmaddubsw` kernel: `vpdpbusd` in its place was no faster (4 accumulator chains there).

Why C: the quads, the broadcast words and the saturating pairs are one intrinsic each here; the
products are specialised per head size (16, 32, 64, 128) and called from the TIR kernel with
`call_extern`, as the bf16 products are (attention_bf16.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from . import int8
from .attention_bf16 import EXP_MACROS
from .int8 import PAIR_CODES, WEIGHT_CODES
from .objects import c_object

HEAD_SIZES = (16, 32, 64, 128)  # head sizes the products are compiled for (the staging takes multiples of 16)
LANES = (8, 16)  # fp32 / int32 lanes of a ymm (AVX2) or a zmm (AVX512BW) register
QUERIES = 16  # queries per tile: two ymm registers, one zmm
KEY_STEP = 4  # keys are staged (zero past the last) to whole quads
TILE = "bert_int8_attention_d{head}"
STAGE_KEYS = "bert_int8_stage_keys"
STAGE_VALUES = "bert_int8_stage_values"
QUERY_QUADS = "bert_int8_query_quads"
PROBABILITY_CODES = 255  # exp(s - max) in [0, 1] onto u8
QUERY_OFFSET = 128  # a query code's offset into u8

_MACROS = {**EXP_MACROS, "BERT_PAIR_CODES": PAIR_CODES, "BERT_CODES": WEIGHT_CODES,
           "BERT_LOG_PROBABILITY_CODES": math.log(PROBABILITY_CODES), "BERT_QUERY_OFFSET": QUERY_OFFSET}


def _for_width(template: str, bits: int) -> str:
    """C written once for `bits`-wide registers (256: ymm, 512: zmm): @mm the intrinsics' prefix, @vi and @vf
    the integer and float register types, @si the integer intrinsics' suffix, @lanes the 32-bit lanes."""
    return (template.replace("@mm", f"_mm{bits}").replace("@vi", f"__m{bits}i").replace("@vf", f"__m{bits}")
            .replace("@si", f"si{bits}").replace("@lanes", str(bits // 32)))


# The low byte of each 32-bit lane of a, b, c, d as one word per lane ((a, b, c, d) from the lowest byte).
_QUAD_WORDS = r"""
static inline @vi bert_quad_words@lanes(@vi a, @vi b, @vi c, @vi d) {
  const @vi byte = @mm_set1_epi32(0xFF);
  return @mm_or_@si(@mm_or_@si(@mm_and_@si(a, byte), @mm_slli_epi32(@mm_and_@si(b, byte), 8)),
                    @mm_or_@si(@mm_slli_epi32(@mm_and_@si(c, byte), 16), @mm_slli_epi32(d, 24)));
}
"""

# The 4 bytes at p broadcast to every 32-bit lane (an unaligned word: memcpy, not a cast).
_WORD_AT = r"""
static inline @vi bert_word_at@lanes(const void *p) {
  int32_t word;
  memcpy(&word, p, sizeof word);
  return @mm_set1_epi32(word);
}
"""

# exp(x) for x <= ln 255 (attention_bf16.py's bert_exp: 2^n x p(r)), the same values at either width. Adding
# 1.5 x 2^23 + 127 rounds x / ln 2 to the nearest integer n and leaves n + 127, the exponent field of 2^n, in the
# sum's low bits (fast_math.py's reduction): one shift makes 2^n.
_EXP = r"""
static inline @vf bert_exp@lanes(@vf x) {
  const @vf shift = @mm_set1_ps(12582912.0f + 127.0f);
  x = @mm_max_ps(x, @mm_set1_ps(BERT_EXP_FLOOR));
  @vf shifted = @mm_fmadd_ps(x, @mm_set1_ps(BERT_EXP_LOG2E), shift);
  @vf r = @mm_fnmadd_ps(@mm_sub_ps(shifted, shift), @mm_set1_ps(BERT_EXP_LN2), x);
  @vf p = @mm_fmadd_ps(@mm_set1_ps(BERT_EXP_P3), r, @mm_set1_ps(BERT_EXP_P2));
  p = @mm_fmadd_ps(p, r, @mm_set1_ps(BERT_EXP_P1));
  p = @mm_fmadd_ps(p, r, @mm_set1_ps(BERT_EXP_P0));
  return @mm_mul_ps(p, @mm_cast@si_ps(@mm_slli_epi32(@mm_castps_@si(shifted), 23)));
}
"""

# context[16][head] = probs x values x value_scales x inverse (each query's 1 / its sum of codes), over `quads`
# key quads: QP queries x DP registers of @lanes dims a pass, in 16 accumulators on zmm (vpdpbusd's 5-cycle
# latency wants 10 or more independent chains), 4 on ymm (which leaves registers for the ones vector, the values
# and a broadcast).
_CONTEXT = r"""
static inline __attribute__((always_inline)) void bert_context(float *context, const uint32_t *probs,
                                                               const int8_t *values, const float *value_scales,
                                                               const float *inverse, int64_t quads, const int head) {
  enum { LANES = @lanes, ACCS = @lanes == 16 ? 16 : 4 };
  const int DV = head / LANES, DP = DV < 4 ? DV : 4, QP = ACCS / DP;
  for (int part = 0; part < DV / DP; ++part)
    for (int first = 0; first < 16; first += QP) {
      @vi acc[ACCS], w[4];
      _Pragma("GCC unroll 16") for (int i = 0; i < QP * DP; ++i) acc[i] = @mm_setzero_@si();
      for (int64_t p = 0; p < quads; ++p) {
        const int8_t *v = values + (p * head + LANES * DP * part) * 4;
        _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d) w[d] = @mm_loadu_@si((const void *)(v + 4 * LANES * d));
        _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q) {
          @vi u8 = @mm_set1_epi32((int32_t)probs[16 * p + first + q]);
          _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d)
            acc[q * DP + d] = bert_dot@lanes(acc[q * DP + d], u8, w[d]);
        }
      }
      _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q) {
        @vf norm = @mm_set1_ps(inverse[first + q]);
        _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d) {
          int dim = LANES * (DP * part + d);
          @mm_storeu_ps(context + (first + q) * head + dim,
                        @mm_mul_ps(@mm_mul_ps(@mm_cvtepi32_ps(acc[q * DP + d]), norm),
                                   @mm_loadu_ps(value_scales + dim)));
        }
      }
    }
}
"""

SOURCE = "".join(f"#define {name} {value!r}{'f' if isinstance(value, float) else ''}\n"
                 for name, value in _MACROS.items()) + r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

""" + _for_width(_QUAD_WORDS, 256) + r"""
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

#ifdef __AVX512BW__
""" + _for_width(_EXP, 512) + _for_width(_QUAD_WORDS, 512) + _for_width(_WORD_AT, 512) + r"""
static inline __m512i bert_dot16(__m512i acc, __m512i u8, __m512i s8) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}
""" + _for_width(_CONTEXT, 512) + r"""
/* keys first .. first + N - 1 against the tile's queries: their scores written and the running max. */
static inline __attribute__((always_inline)) __m512 bert_score_block16(
    float *scores, const uint8_t *queries, const int8_t *keys, const int32_t *key_init, const float *key_scales,
    const float *bias, __m512 scale, __m512 top, int64_t first, int64_t length, const int N, const int head) {
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
      top = _mm512_max_ps(top, s);
    }
    _mm512_storeu_ps(scores + 16 * j, s);
  }
  return top;
}

/* The same tile on zmm registers (AVX512BW; `vpdpbusd` where the CPU has AVX512_VNNI): one register is the
   tile's 16 queries. The scores take 16 keys a block (then 4), each key's broadcast quad folded into its
   product; the context 16 accumulators, QP queries x DP registers of 16 dims a pass. */
#define TILE(HEAD)                                                                                          \
  int32_t bert_int8_attention_d##HEAD(float *context, const uint8_t *queries, const float *query_scales,   \
                                      const int8_t *keys, const int32_t *key_init, const float *key_scales, \
                                      const int8_t *values, const float *value_scales, const float *bias,  \
                                      int64_t length, float *scores, uint32_t *probs) {                    \
    const __m512 scale = _mm512_loadu_ps(query_scales);                                                    \
    __m512 top = _mm512_set1_ps(-__FLT_MAX__);                                                             \
    const int64_t staged = (length + 3) / 4 * 4;                                                           \
    int64_t first = 0;                                                                                     \
    for (; first + 16 <= staged; first += 16)                                                              \
      top = bert_score_block16(scores, queries, keys, key_init, key_scales, bias, scale, top, first, length, 16,  \
                               HEAD);                                                                      \
    for (; first < staged; first += 4)                                                                     \
      top = bert_score_block16(scores, queries, keys, key_init, key_scales, bias, scale, top, first, length, 4,   \
                               HEAD);                                                                      \
    top = _mm512_sub_ps(top, _mm512_set1_ps(BERT_LOG_PROBABILITY_CODES)); /* exp(s - top) x 255 */        \
    __m512i sum = _mm512_setzero_si512();                                                                  \
    for (int64_t p = 0; p < staged / 4; ++p) {                                                             \
      __m512i c[4];                                                                                        \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                \
        c[i] = _mm512_cvtps_epi32(bert_exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + 16 * (4 * p + i)), top))); \
        sum = _mm512_add_epi32(sum, c[i]);                                                                 \
      }                                                                                                    \
      _mm512_storeu_si512((void *)(probs + 16 * p), bert_quad_words16(c[0], c[1], c[2], c[3]));           \
    }                                                                                                      \
    float inverse[16];                                                                                     \
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(sum)));               \
    bert_context(context, probs, values, value_scales, inverse, staged / 4, HEAD);                        \
    return 0;                                                                                              \
  }
#else
""" + _for_width(_EXP, 256) + _for_width(_WORD_AT, 256) + r"""
/* acc + the 4 u8 x s8 products of each 32-bit lane: pairs in saturating int16 (`vpmaddubsw`, exact under the
   pair bound), then pairs of those in int32 (`vpmaddwd` by ones). */
static inline __m256i bert_dot8(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
""" + _for_width(_CONTEXT, 256) + r"""
/* One tile of 16 queries: scores[j][16] = (keys[j] . queries) x the two scales + bias[j] for the keys
   j < length (4 keys x 2 registers of queries a block), each query's largest; probs[j / 4][16] = the
   quads of exp(scores - largest) onto 0..255 (keys past `length` 0), with each query's sum of codes;
   context[16][HEAD] = probs x values x value_scales / that sum (QP queries x DP registers of dims a
   pass). */
#define TILE(HEAD)                                                                                          \
  int32_t bert_int8_attention_d##HEAD(float *context, const uint8_t *queries, const float *query_scales,   \
                                      const int8_t *keys, const int32_t *key_init, const float *key_scales, \
                                      const int8_t *values, const float *value_scales, const float *bias,  \
                                      int64_t length, float *scores, uint32_t *probs) {                    \
    enum { QUADS = HEAD / 4 };                                                                             \
    const __m256 scale_lo = _mm256_loadu_ps(query_scales), scale_hi = _mm256_loadu_ps(query_scales + 8);    \
    __m256 top_lo = _mm256_set1_ps(-__FLT_MAX__), top_hi = top_lo;                                         \
    for (int64_t block = 0; block < (length + 3) / 4; ++block) {                                           \
      __m256i lo[4], hi[4];                                                                                \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm256_set1_epi32(key_init[4 * block + i]); \
      const int8_t *k = keys + 4 * block * HEAD;                                                           \
      for (int t = 0; t < QUADS; ++t) {                                            \
        __m256i q_lo = _mm256_loadu_si256((const __m256i *)(queries + 64 * t));                            \
        __m256i q_hi = _mm256_loadu_si256((const __m256i *)(queries + 64 * t + 32));                       \
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                              \
          __m256i w = bert_word_at8(k + i * HEAD + 4 * t);                                                 \
          lo[i] = bert_dot8(lo[i], q_lo, w);                                                               \
          hi[i] = bert_dot8(hi[i], q_hi, w);                                                               \
        }                                                                                                  \
      }                                                                                                    \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                \
        int64_t j = 4 * block + i;                                                                         \
        if (j < length) {                                                                                  \
          __m256 ks = _mm256_set1_ps(key_scales[j]), b = _mm256_set1_ps(bias[j]);                          \
          __m256 s_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), _mm256_mul_ps(scale_lo, ks), b);        \
          __m256 s_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), _mm256_mul_ps(scale_hi, ks), b);        \
          _mm256_storeu_ps(scores + 16 * j, s_lo);                                                         \
          _mm256_storeu_ps(scores + 16 * j + 8, s_hi);                                                     \
          top_lo = _mm256_max_ps(top_lo, s_lo);                                                            \
          top_hi = _mm256_max_ps(top_hi, s_hi);                                                            \
        } else { /* past the last key: a score whose probability code is 0 */                              \
          _mm256_storeu_ps(scores + 16 * j, _mm256_set1_ps(-__FLT_MAX__));                                 \
          _mm256_storeu_ps(scores + 16 * j + 8, _mm256_set1_ps(-__FLT_MAX__));                             \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    /* exp(s - top) x 255 = exp(s - (top - ln 255)) */                                                    \
    const __m256 log_codes = _mm256_set1_ps(BERT_LOG_PROBABILITY_CODES);                                   \
    top_lo = _mm256_sub_ps(top_lo, log_codes);                                                             \
    top_hi = _mm256_sub_ps(top_hi, log_codes);                                                             \
    __m256i sum_lo = _mm256_setzero_si256(), sum_hi = sum_lo;                                              \
    const int64_t quads = (length + 3) / 4;                                                                \
    for (int64_t p = 0; p < quads; ++p) {                                                                  \
      __m256i c_lo[4], c_hi[4];                                                                            \
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                \
        const float *s = scores + 16 * (4 * p + i);                                                        \
        c_lo[i] = _mm256_cvtps_epi32(bert_exp8(_mm256_sub_ps(_mm256_loadu_ps(s), top_lo)));                \
        c_hi[i] = _mm256_cvtps_epi32(bert_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8), top_hi)));            \
        sum_lo = _mm256_add_epi32(sum_lo, c_lo[i]);                                                        \
        sum_hi = _mm256_add_epi32(sum_hi, c_hi[i]);                                                        \
      }                                                                                                    \
      _mm256_storeu_si256((__m256i *)(probs + 16 * p), bert_quad_words8(c_lo[0], c_lo[1], c_lo[2], c_lo[3])); \
      _mm256_storeu_si256((__m256i *)(probs + 16 * p + 8), bert_quad_words8(c_hi[0], c_hi[1], c_hi[2], c_hi[3])); \
    }                                                                                                      \
    float inverse[16];                                                                                     \
    _mm256_storeu_ps(inverse, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(sum_lo)));            \
    _mm256_storeu_ps(inverse + 8, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(sum_hi)));        \
    bert_context(context, probs, values, value_scales, inverse, quads, HEAD);                             \
    return 0;                                                                                              \
  }

#endif

TILE(16) TILE(32) TILE(64) TILE(128)
"""


def supports(head_size: int, lanes: int) -> bool:
    """Whether the int8 products are compiled for this head size and vector width (AVX2's ymm or
    AVX-512's zmm)."""
    return lanes in LANES and head_size in HEAD_SIZES


def kernels_object(kernel: int8.Int8Kernel) -> Path:
    """The products and their staging for the CPUs of an int8 linear `kernel`, compiled once per process to an
    object file the libraries link: zmm tiles where it has AVX512BW (with `vpdpbusd` where VNNI), else ymm.
    Without -fno-tree-coalesce-vars GCC 12 copies each accumulator to a fresh register every step of the
    ymm products' loops, and spills two of them."""
    isa = {int8.VNNI: ("-mavx512f", "-mavx512bw", "-mavx512vnni"),
           int8.AVX512BW: ("-mavx512f", "-mavx512bw")}.get(kernel, ("-mavx2",))
    return c_object(f"int8_attention_{kernel.name}", SOURCE, (*isa, "-mfma", "-fno-tree-coalesce-vars"))


def linked_objects(kernel: int8.Int8Kernel | None, products: str) -> list[str]:
    """What a library whose attention products are `products` must link for them, on the CPUs of the int8
    linears' `kernel`."""
    return [str(kernels_object(kernel))] if products == "int8" and kernel is not None else []
