/* The rate of vpdpbusd on zmm from registers: 12 independent chains, one thread.
   gcc -O2 -march=native -o /tmp/vpdpbusd_peak vpdpbusd_peak.c && /tmp/vpdpbusd_peak */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define D(x) x = _mm512_dpbusd_epi32(x, a, b);
int main(int argc, char **argv) {
  __m512i a0=_mm512_set1_epi32(argc),a1=_mm512_set1_epi32(argc+1),a2=_mm512_set1_epi32(argc+2),a3=_mm512_set1_epi32(argc+3),a4=_mm512_set1_epi32(argc+4),a5=_mm512_set1_epi32(argc+5),a6=_mm512_set1_epi32(argc+6),a7=_mm512_set1_epi32(argc+7),a8=_mm512_set1_epi32(argc+8),a9=_mm512_set1_epi32(argc+9),a10=_mm512_set1_epi32(argc+10),a11=_mm512_set1_epi32(argc+11);
  __m512i a = _mm512_set1_epi32(0x01020304 + argc), b = _mm512_set1_epi32(0x01010101);
  long n = 200000000; double t0 = now();
  for (long k = 0; k < n; ++k) { D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7) D(a8) D(a9) D(a10) D(a11) }
  double t = now() - t0;
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(a6,a7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8,a9),_mm512_add_epi32(a10,a11)));
  printf("vpdpbusd zmm: %.1f GMAC/s (%.2f G instr/s) %d\n", n * 12.0 * 64 / t / 1e9, n * 12.0 / t / 1e9, _mm512_reduce_add_epi32(s));
  return 0;
}
