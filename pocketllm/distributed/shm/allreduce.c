/* The shared-memory all-reduce of ranks on one host: copy in, flag, reduce, flag, copy out.
 *
 * Segment layout (every offset a multiple of LINE, so no two ranks' flags share a cache line):
 *   line 0                 header: world, chunk bytes
 *   line 1 + r             pid of rank r (read only when a wait runs long, to notice a dead peer)
 *   line 1 + W + r         arrive[r]:  the last generation rank r copied its input in for
 *   line 1 + 2W + r        reduced[r]: the last generation rank r wrote its part of the result for
 *   then, per parity p in {0, 1}: W input regions of `chunk` bytes, then one result region.
 *
 * One generation is one chunk of one call; a rank's generation is its own arrive flag plus one,
 * so back-to-back calls need no reset. Generation g uses the regions of parity g & 1.
 *
 * Memory ordering. Each flag is written by one rank only, with a release store, after that
 * rank's plain writes of the data it announces (its input region, its part of the result); peers
 * read it with an acquire load before they read that data. Release/acquire on the same atomic
 * makes every write before the store visible to every read after the load (C11 5.1.2.4), on any
 * CPU GCC targets: on x86 the stores are ordered anyway and the builtins only stop the compiler
 * reordering; on Arm they emit stlr/ldar. The flags are lock-free 64-bit atomics, which are
 * address-free, so each process may map the segment at its own address.
 *
 * Why two parities are enough: a rank starts generation g only after it saw every peer's
 * arrive >= g-1, and a peer stores arrive = g-1 only after it finished generation g-2, the last
 * one that read the regions of parity g & 1. So nobody still reads what generation g overwrites.
 * A peer may already be at g+1 while this rank waits at g (hence ">=" in every wait); it then
 * writes the other parity.
 *
 * Small payloads reduce in one step (each rank reads every input region itself, one flag wait);
 * larger ones are a reduce-scatter (each rank reduces 1/W of the elements into the result region)
 * and an all-gather (each rank copies the rest of the result out), two flag waits but W times
 * fewer reads per rank. A rank never copies in, or copies out, the part it reduces itself: it
 * reads that part of its input where it is and writes that part of the sum straight back.
 *
 * bf16 and fp16 are summed in fp32, in rank order, and rounded once; fp32 is summed in rank order.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#define LINE 128
#define BLOCK 512

enum { PL_F32 = 0, PL_BF16 = 1, PL_F16 = 2 };
enum { PL_OK = 0, PL_TIMEOUT = 1, PL_PEER_GONE = 2 };

/* A wait spins for spin_ns, then yields its core until yield_ns, then sleeps SLEEP_NS between
 * looks (the caller picks the two). Spinning is the fast path when every rank has its own core;
 * yielding lets a peer that shares the core run; sleeping keeps a rank that waits on a slow or
 * stopped peer from burning a core. */
#define SLEEP_NS 100000L
/* How often a long wait checks that the peer it waits for still exists. */
#define PEER_CHECK_NS 100000000LL

static size_t lines_before_data(int world) { return 1 + 3 * (size_t)world; }

size_t pl_segment_bytes(int world, size_t chunk)
{
    return lines_before_data(world) * LINE + 2 * ((size_t)world + 1) * chunk;
}

static uint64_t *flag(char *base, int world, int which, int rank)
{
    return (uint64_t *)(base + (1 + (size_t)(which + 1) * world + rank) * LINE);
}

static int32_t *pid_slot(char *base, int rank) { return (int32_t *)(base + (1 + (size_t)rank) * LINE); }

static char *region(char *base, int world, size_t chunk, int parity, int r)
{
    return base + lines_before_data(world) * LINE + ((size_t)parity * (world + 1) + r) * chunk;
}

void pl_attach(char *base, int world, int rank, size_t chunk, int32_t pid)
{
    if (rank == 0) {
        ((uint64_t *)base)[0] = (uint64_t)world;
        ((uint64_t *)base)[1] = (uint64_t)chunk;
    }
    __atomic_store_n(pid_slot(base, rank), pid, __ATOMIC_RELEASE);
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Whether rank r's process has ended: no such pid, or a zombie its parent has not reaped yet. */
static int peer_gone(char *base, int r)
{
    pid_t pid = __atomic_load_n(pid_slot(base, r), __ATOMIC_ACQUIRE);
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t len = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[len] = 0;
    /* The state follows the command name's closing parenthesis. */
    char *close = strrchr(stat, ')');
    return close != NULL && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

/* Wait until every peer's flag `which` reaches g. Returns PL_OK, PL_TIMEOUT, or
 * PL_PEER_GONE + r for the first peer found gone. */
static int wait_all(char *base, int world, int rank, int which, uint64_t g, long long deadline, long long spin_ns,
                    long long yield_ns)
{
    for (int r = 0; r < world; r++) {
        if (r == rank)
            continue;
        uint64_t *f = flag(base, world, which, r);
        long long start = 0, next_check = 0;
        for (unsigned spins = 0; __atomic_load_n(f, __ATOMIC_ACQUIRE) < g; spins++) {
            if ((spins & 15) != 15) {
                cpu_relax();
                continue;
            }
            long long t = now_ns();
            if (start == 0) {
                start = t;
                next_check = t + PEER_CHECK_NS;
            }
            if (t > deadline)
                return PL_TIMEOUT;
            if (t > next_check) {
                if (peer_gone(base, r))
                    return PL_PEER_GONE + r;
                next_check = t + PEER_CHECK_NS;
            }
            if (t - start < spin_ns) {
                cpu_relax();
            } else if (t - start < yield_ns) {
                sched_yield();
            } else {
                struct timespec nap = {0, SLEEP_NS};
                nanosleep(&nap, NULL);
            }
        }
    }
    return PL_OK;
}

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch converts fp32 to bf16. A NaN stays a NaN: 0x7fc0, as
 * torch's scalar conversion gives (its vectorised one gives 0xffff, also a NaN). */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* out[i] = sum over r of src[r][i] for i in [lo, hi), accumulated in fp32 in rank order. out may
 * not alias any src. Blocks of BLOCK elements keep the fp32 accumulator in L1 and every inner loop
 * a plain one the compiler vectorises. */
void pl_reduce(int dtype, void *out, void *const *src, int world, size_t lo, size_t hi)
{
    float acc[BLOCK];
    for (size_t b = lo; b < hi; b += BLOCK) {
        size_t n = hi - b < BLOCK ? hi - b : BLOCK;
        if (dtype == PL_F32) {
            const float *s0 = (const float *)src[0] + b;
            for (size_t i = 0; i < n; i++)
                acc[i] = s0[i];
            for (int r = 1; r < world; r++) {
                const float *s = (const float *)src[r] + b;
                for (size_t i = 0; i < n; i++)
                    acc[i] += s[i];
            }
            memcpy((float *)out + b, acc, n * sizeof(float));
        } else if (dtype == PL_BF16) {
            const uint16_t *s0 = (const uint16_t *)src[0] + b;
            for (size_t i = 0; i < n; i++)
                acc[i] = bf16_to_f32(s0[i]);
            for (int r = 1; r < world; r++) {
                const uint16_t *s = (const uint16_t *)src[r] + b;
                for (size_t i = 0; i < n; i++)
                    acc[i] += bf16_to_f32(s[i]);
            }
            uint16_t *o = (uint16_t *)out + b;
            for (size_t i = 0; i < n; i++)
                o[i] = f32_to_bf16(acc[i]);
        } else {
            const _Float16 *s0 = (const _Float16 *)src[0] + b;
            for (size_t i = 0; i < n; i++)
                acc[i] = (float)s0[i];
            for (int r = 1; r < world; r++) {
                const _Float16 *s = (const _Float16 *)src[r] + b;
                for (size_t i = 0; i < n; i++)
                    acc[i] += (float)s[i];
            }
            /* The conversion rounds in the current rounding mode: to nearest, ties to even. */
            _Float16 *o = (_Float16 *)out + b;
            for (size_t i = 0; i < n; i++)
                o[i] = (_Float16)acc[i];
        }
    }
}

/* The in-place sum of `n` elements at `data` over every rank. Returns PL_OK, PL_TIMEOUT (a peer
 * did not arrive by `timeout_s` after the call began) or PL_PEER_GONE + r. */
int pl_all_reduce(char *base, int world, int rank, size_t chunk, int dtype, void *data, size_t n, double timeout_s,
                  size_t one_step_bytes, long long spin_ns, long long yield_ns)
{
    size_t es = dtype == PL_F32 ? 4 : 2;
    size_t per_chunk = chunk / es;
    long long deadline = now_ns() + (long long)(timeout_s * 1e9);
    uint64_t *mine = flag(base, world, 0, rank);
    uint64_t *done = flag(base, world, 1, rank);
    void *src[64];
    if (world > 64)
        return PL_TIMEOUT;
    for (size_t off = 0; off < n; off += per_chunk) {
        size_t m = n - off < per_chunk ? n - off : per_chunk;
        char *at = (char *)data + off * es;
        uint64_t g = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
        int parity = (int)(g & 1);
        for (int r = 0; r < world; r++)
            src[r] = region(base, world, chunk, parity, r);
        int one_step = m * es <= one_step_bytes;
        /* Parts end on 64-element boundaries: whole cache lines of the result per rank. */
        size_t part = ((m + world - 1) / world + 63) / 64 * 64;
        size_t lo = one_step ? 0 : (part * rank < m ? part * rank : m);
        size_t hi = one_step ? 0 : (lo + part < m ? lo + part : m);
        /* Peers read every element of this rank's input but the part it reduces itself. */
        memcpy(src[rank], at, lo * es);
        memcpy(src[rank] + hi * es, at + hi * es, (m - hi) * es);
        __atomic_store_n(mine, g, __ATOMIC_RELEASE);
        int rc = wait_all(base, world, rank, 0, g, deadline, spin_ns, yield_ns);
        if (rc != PL_OK)
            return rc;
        /* This rank's own input is read where it is. In one step the sum overwrites it block by
         * block, each block read whole before it is written. */
        src[rank] = at;
        if (one_step) {
            pl_reduce(dtype, at, src, world, 0, m);
            /* Kept in step with the arrive flag, so a later large chunk's wait on it is right. */
            __atomic_store_n(done, g, __ATOMIC_RELEASE);
            continue;
        }
        char *result = region(base, world, chunk, parity, world);
        pl_reduce(dtype, result, src, world, lo, hi);
        __atomic_store_n(done, g, __ATOMIC_RELEASE);
        memcpy(at + lo * es, result + lo * es, (hi - lo) * es);
        rc = wait_all(base, world, rank, 1, g, deadline, spin_ns, yield_ns);
        if (rc != PL_OK)
            return rc;
        memcpy(at, result, lo * es);
        memcpy(at + hi * es, result + hi * es, (m - hi) * es);
    }
    return PL_OK;
}
