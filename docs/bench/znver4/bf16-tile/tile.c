/* The bf16 linears' micro-kernel (compile/kernels/bf16.py: 8 x 32, broadcast activation pairs, vdpbf16ps) and
   other register tiles, timed alone over a [M, K] x [K, N] product whose weights stay in L2/L3:
   gcc -O3 -march=native -o /tmp/tile tile.c && /tmp/tile M N K   (GMAC/s of one thread, 3 rounds). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TILE(R, NV, NAME) \
int32_t NAME(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t pairs) { \
  __m512 acc[R][NV]; \
  _Pragma("GCC unroll 16") for (int i = 0; i < R; ++i) \
  _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps(); \
  for (int64_t p = 0; p < pairs; ++p) { \
    __m512bh bv[NV]; \
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * 32 * NV + 32 * v); \
    _Pragma("GCC unroll 16") for (int i = 0; i < R; ++i) { \
      int32_t pair; memcpy(&pair, a + i * lda + 2 * p, sizeof pair); \
      __m512bh x = (__m512bh)_mm512_set1_epi32(pair); \
      _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], x, bv[v]); \
    } \
  } \
  _Pragma("GCC unroll 16") for (int i = 0; i < R; ++i) \
  _Pragma("GCC unroll 4") for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]); \
  return 0; }

TILE(8, 2, t8x32)
TILE(8, 3, t8x48)
TILE(6, 4, t6x64)
TILE(12, 2, t12x32)
TILE(4, 4, t4x64)

typedef int32_t (*tile_fn)(float *, int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static double run(tile_fn f, int R, int P, int M, int N, int K, uint16_t *A, uint16_t *B, float *C, int reps) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    for (int j = 0; j < N / P; ++j)
      for (int i = 0; i + R <= M; i += R)
        f(C + (int64_t)i * N + j * P, N, A + (int64_t)i * K, K, B + (int64_t)j * K * P, K / 2);
    double t = now() - t0;
    if (t < best) best = t;
  }
  int Mu = M / R * R;
  return (double)Mu * N * K / best / 1e9;
}

int main(int argc, char **argv) {
  int M = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]);
  uint16_t *A = aligned_alloc(64, (size_t)M * K * 2), *B = aligned_alloc(64, (size_t)N * K * 2);
  float *C = aligned_alloc(64, (size_t)M * N * 4);
  for (size_t i = 0; i < (size_t)M * K; ++i) A[i] = 0x3f80 + (i % 7);
  for (size_t i = 0; i < (size_t)N * K; ++i) B[i] = 0x3f80 + (i % 5);
  struct { tile_fn f; int R, P; const char *n; } ts[] = {{t8x32, 8, 32, "8x32"}, {t8x48, 8, 48, "8x48"}, {t6x64, 6, 64, "6x64"}, {t12x32, 12, 32, "12x32"}, {t4x64, 4, 64, "4x64"}};
  for (int round = 0; round < 3; ++round)
    for (int t = 0; t < 5; ++t) {
      if (N % ts[t].P) continue;
      printf("%s %dx%dx%d: %.1f GMAC/s\n", ts[t].n, M, N, K, run(ts[t].f, ts[t].R, ts[t].P, M, N, K, A, B, C, 20));
    }
  return 0;
}
