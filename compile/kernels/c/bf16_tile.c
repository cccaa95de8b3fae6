/* The bf16 linears' micro-kernel (compile/kernels/bf16.py), AVX512_BF16: per k pair, two panel loads and 8
   row-pair broadcasts feed 16 `vdpbf16ps`, all 16 accumulators in registers. */
#include "kernels.h"

/* c[8][32] (row stride ldc floats) = a[8][2 * pairs] (row stride lda) x the panel b[pairs][32][2]. */
int32_t bert_bf16_tile_8x32(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint16_t *b,
                            int64_t pairs) {
  __m512 acc[8][2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 64);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 64 + 32);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      int32_t pair;
      memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
      __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc[i][0]);
    _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
  }
  return 0;
}
