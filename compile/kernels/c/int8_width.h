/* The int8 attention's helpers at one register width (attention_int8.c), written once: included once per
   width with BERT_BITS defined, 256 (ymm: names ending in 8, its 32-bit lanes) or 512 (zmm: in 16). No include
   guard, on purpose; its macros are undefined at the end. */
#if BERT_BITS == 512
#define BERT_W(name) name##16
#define BERT_W_LANES 16
#define BERT_VI __m512i
#define BERT_VF __m512
#define BERT_MM(op) _mm512_##op
#define BERT_SI(op) _mm512_##op##_si512
#define BERT_CASTSI_PS _mm512_castsi512_ps
#define BERT_CASTPS_SI _mm512_castps_si512
#elif BERT_BITS == 256
#define BERT_W(name) name##8
#define BERT_W_LANES 8
#define BERT_VI __m256i
#define BERT_VF __m256
#define BERT_MM(op) _mm256_##op
#define BERT_SI(op) _mm256_##op##_si256
#define BERT_CASTSI_PS _mm256_castsi256_ps
#define BERT_CASTPS_SI _mm256_castps_si256
#else
#error "BERT_BITS is 256 or 512"
#endif

/* The low byte of each 32-bit lane of a, b, c, d as one word per lane ((a, b, c, d) from the lowest byte). */
static inline BERT_VI BERT_W(bert_quad_words)(BERT_VI a, BERT_VI b, BERT_VI c, BERT_VI d) {
  const BERT_VI byte = BERT_MM(set1_epi32)(0xFF);
  return BERT_SI(or)(BERT_SI(or)(BERT_SI(and)(a, byte), BERT_MM(slli_epi32)(BERT_SI(and)(b, byte), 8)),
                     BERT_SI(or)(BERT_MM(slli_epi32)(BERT_SI(and)(c, byte), 16), BERT_MM(slli_epi32)(d, 24)));
}

/* The 4 bytes at p broadcast to every 32-bit lane (an unaligned word: memcpy, not a cast). */
static inline BERT_VI BERT_W(bert_word_at)(const void *p) {
  int32_t word;
  memcpy(&word, p, sizeof word);
  return BERT_MM(set1_epi32)(word);
}

/* exp(x) for x <= ln 255 (attention_bf16.c's bert_exp: 2^n x p(r)), the same values at either width. Adding
   1.5 x 2^23 + 127 rounds x / ln 2 to the nearest integer n and leaves n + 127, the exponent field of 2^n, in
   the sum's low bits (fast_math.py's reduction): one shift makes 2^n. */
static inline BERT_VF BERT_W(bert_exp)(BERT_VF x) {
  const BERT_VF shift = BERT_MM(set1_ps)(12582912.0f + 127.0f);
  x = BERT_MM(max_ps)(x, BERT_MM(set1_ps)(BERT_EXP_FLOOR));
  BERT_VF shifted = BERT_MM(fmadd_ps)(x, BERT_MM(set1_ps)(BERT_EXP_LOG2E), shift);
  BERT_VF r = BERT_MM(fnmadd_ps)(BERT_MM(sub_ps)(shifted, shift), BERT_MM(set1_ps)(BERT_EXP_LN2), x);
  BERT_VF p = BERT_MM(fmadd_ps)(BERT_MM(set1_ps)(BERT_EXP_P3), r, BERT_MM(set1_ps)(BERT_EXP_P2));
  p = BERT_MM(fmadd_ps)(p, r, BERT_MM(set1_ps)(BERT_EXP_P1));
  p = BERT_MM(fmadd_ps)(p, r, BERT_MM(set1_ps)(BERT_EXP_P0));
  return BERT_MM(mul_ps)(p, BERT_CASTSI_PS(BERT_MM(slli_epi32)(BERT_CASTPS_SI(shifted), 23)));
}

/* acc + the 4 u8 x s8 products of each 32-bit lane: `vpdpbusd` on zmm where the CPU has AVX512_VNNI, else
   pairs in saturating int16 (`vpmaddubsw`, exact under the pair bound), then pairs of those in int32
   (`vpmaddwd` by ones). */
static inline BERT_VI BERT_W(bert_dot)(BERT_VI acc, BERT_VI u8, BERT_VI s8) {
#if BERT_BITS == 512 && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return BERT_MM(add_epi32)(acc, BERT_MM(madd_epi16)(BERT_MM(maddubs_epi16)(u8, s8), BERT_MM(set1_epi16)(1)));
#endif
}

/* context[16][head] = probs x values x value_scales x inverse (each query's 1 / its sum of codes), over `quads`
   key quads: QP queries x DP registers of BERT_W_LANES dims a pass, in 16 accumulators on zmm (vpdpbusd's
   5-cycle latency wants 10 or more independent chains), 4 on ymm (which leaves registers for the ones vector,
   the values and a broadcast). */
static inline __attribute__((always_inline)) void BERT_W(bert_context)(float *context, const uint32_t *probs,
                                                                       const int8_t *values, const float *value_scales,
                                                                       const float *inverse, int64_t quads,
                                                                       const int head) {
  enum { LANES = BERT_W_LANES, ACCS = LANES == 16 ? 16 : 4 };
  const int DV = head / LANES, DP = DV < 4 ? DV : 4, QP = ACCS / DP;
  for (int part = 0; part < DV / DP; ++part)
    for (int first = 0; first < 16; first += QP) {
      BERT_VI acc[ACCS], w[4];
      _Pragma("GCC unroll 16") for (int i = 0; i < QP * DP; ++i) acc[i] = BERT_SI(setzero)();
      for (int64_t p = 0; p < quads; ++p) {
        const int8_t *v = values + (p * head + LANES * DP * part) * 4;
        _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d) w[d] = BERT_SI(loadu)((const void *)(v + 4 * LANES * d));
        _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q) {
          BERT_VI u8 = BERT_MM(set1_epi32)((int32_t)probs[16 * p + first + q]);
          _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d) acc[q * DP + d] =
              BERT_W(bert_dot)(acc[q * DP + d], u8, w[d]);
        }
      }
      _Pragma("GCC unroll 16") for (int q = 0; q < QP; ++q) {
        BERT_VF norm = BERT_MM(set1_ps)(inverse[first + q]);
        _Pragma("GCC unroll 4") for (int d = 0; d < DP; ++d) {
          int dim = LANES * (DP * part + d);
          BERT_MM(storeu_ps)(context + (first + q) * head + dim,
                             BERT_MM(mul_ps)(BERT_MM(mul_ps)(BERT_MM(cvtepi32_ps)(acc[q * DP + d]), norm),
                                             BERT_MM(loadu_ps)(value_scales + dim)));
        }
      }
    }
}

#undef BERT_W
#undef BERT_W_LANES
#undef BERT_VI
#undef BERT_VF
#undef BERT_MM
#undef BERT_SI
#undef BERT_CASTSI_PS
#undef BERT_CASTPS_SI
