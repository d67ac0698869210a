/* Software prefetch of weight lines, as the C kernels under pocketllm/ops ask for them. */
#ifndef POCKETLLM_PREFETCH_H
#define POCKETLLM_PREFETCH_H
#include <stdint.h>

/* Where a prefetched line goes; the Python side passes the same codes (quant/native.py). */
enum { PF_NON_TEMPORAL = 0, PF_ALL_LEVELS = 1, PF_L2 = 2 };

/* A weight line asked for ahead of its load: non-temporally (PF_NON_TEMPORAL: it passes by the
 * outer caches, which keep what the rest of a decode step runs on), into every cache level
 * (PF_ALL_LEVELS: more lines in flight where a core's prefetchers fall short of the memory's
 * rate), or into L2 and the outer caches but not L1 (PF_L2: the line waits in L2 for its load,
 * and L1's few fill buffers stay free for the loads of a tile's rows). Which streams faster is
 * measured: each is a candidate. */
static inline void prefetch_weight(const void *p, int64_t where) {
    if (where == PF_ALL_LEVELS)
        __builtin_prefetch(p, 0, 3);
    else if (where == PF_L2)
        __builtin_prefetch(p, 0, 2);
    else
        __builtin_prefetch(p, 0, 0);
}
#endif
