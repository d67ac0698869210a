/* How the C kernels under pocketllm/ops split work over the OpenMP threads torch already runs. */
#ifndef POCKETLLM_THREADS_H
#define POCKETLLM_THREADS_H
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The most threads a parallel region here starts, and this thread's index in its team (1 and 0
 * outside OpenMP): for a buffer with one part per thread. */
static inline int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* This thread's contiguous share [u0, u1) of `units` tiles (all of them outside a parallel
 * region): the split schedule(static) makes, written out so a thread knows where its part starts. */
static inline void thread_units(int64_t units, int64_t *u0, int64_t *u1) {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    *u0 = units * t / nt;
    *u1 = units * (t + 1) / nt;
}

/* Inside a parallel region: whether every thread's `ok` (its own buffers allocated) holds, the
 * same answer on all of them, so a call fails whole rather than part-written. */
static inline int every_thread(int ok, int *failed) {
    if (!ok) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp barrier
    int f;
#pragma omp atomic read
    f = *failed;
    return !f;
}
#endif
