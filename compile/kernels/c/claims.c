/* The claim counter of compile/kernels/launch.py (TIR has no atomics on the CPU). `next` is the loop's first
   unclaimed iteration; a claim takes 1 / spread of those left, at least `grain`, and returns its first
   iteration, its end in `*end`. spread is twice the threads of TVM's pool (TVM_NUM_THREADS, as the pool reads
   it, else the CPUs the process may run on), so no thread's first claim is over half its fair share. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

static int64_t claim_spread(void) {
  static int64_t spread;
  int64_t known = __atomic_load_n(&spread, __ATOMIC_RELAXED);
  if (known == 0) {
    const char *threads = getenv("TVM_NUM_THREADS");
    long count = threads ? strtol(threads, NULL, 10) : 0;
    cpu_set_t cpus;
    if (count <= 0) count = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    known = 2 * (count > 0 ? count : 1);
    __atomic_store_n(&spread, known, __ATOMIC_RELAXED);
  }
  return known;
}

int64_t bert_claim(int64_t *next, int64_t iterations, int64_t grain, int64_t *end) {
  int64_t start = __atomic_load_n(next, __ATOMIC_RELAXED);
  for (;;) {
    if (start >= iterations) {
      *end = start;
      return start;
    }
    int64_t size = (iterations - start) / claim_spread();
    int64_t stop = start + (size > grain ? size : grain);
    if (stop > iterations) stop = iterations;
    if (__atomic_compare_exchange_n(next, &start, stop, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      *end = stop;
      return start;
    }
  }
}
