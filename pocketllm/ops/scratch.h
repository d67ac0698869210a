/* A per-thread buffer the C kernels under pocketllm/ops lay x out in, call after call. */
#ifndef POCKETLLM_SCRATCH_H
#define POCKETLLM_SCRATCH_H
#include <stddef.h>
#include <stdlib.h>

/* A buffer of at least `bytes` (64-byte aligned), kept per calling thread from call to call: the
 * kernels lay x out anew on every call, and a malloc and free per call cost more than a small
 * GEMV's own work. NULL when it cannot grow. */
static inline void *scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t size;
    if (bytes > size) {
        size_t want = (bytes + 4095) & ~(size_t)4095;
        void *p = aligned_alloc(64, want);
        if (p == NULL) return NULL;
        free(buf);
        buf = p, size = want;
    }
    return buf;
}
#endif
