/* What the quantized kernels under pocketllm/ops/quant share: the scale dtypes they read as
 * stored (so a weight keeps its two-byte scales in memory), read one at a time in plain C. */
#ifndef POCKETLLM_QUANT_H
#define POCKETLLM_QUANT_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"
#include "../prefetch.h"
#include "../scratch.h"
#include "../threads.h"

/* The scale dtype codes the Python side passes (kernels.SCALE_KINDS). */
enum { SCALE_BF16 = 0, SCALE_F16 = 1, SCALE_F32 = 2 };

/* IEEE half -> float, exact for every value, subnormals and infinities included. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float scale_at(const void *s, int64_t kind, int64_t i) {
    if (kind == SCALE_BF16) return bf16_to_f32(((const uint16_t *)s)[i]);
    if (kind == SCALE_F16) return f16_to_f32(((const uint16_t *)s)[i]);
    return ((const float *)s)[i];
}

/* A prefetch in plain C too (a hint: it never faults). */
static inline void prefetch_line(const char *p) { __builtin_prefetch(p); }

/* The first `bytes` of a thread's part of the weight asked for at once: its loop's prefetch runs
 * that far ahead, so without this the part's first lines would each wait on memory. */
static inline void prefetch_start(const void *from, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)from + b, 0, 0);
}

/* The path the int8-x kernels (x rounded to int8: gemv_int4_int8x.c, gemv_int8_int8x.c) compile:
 * byte dot products with AVX-512 VNNI, else with AVX2, else none. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT8X_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define INT8X_AVX2
#endif

#if defined(INT8X_AVX512) || defined(INT8X_AVX2)
#include <immintrin.h>
#include <math.h>
/* Block b (inputs 32b..32b+31, zeros past n) of a bf16 x row rounded as the int8-x kernels take
 * it (layout.quantize_x_int8 is the reference): out[i] = rint(x * 127 / largest |x|) in the
 * default to-nearest-even mode; returns the block's scale, largest / 127. A whole block goes
 * through vectors: the same fp32 products, rounded by the conversion in the same mode, the
 * largest |x| skipping a NaN as the loop below does (a NaN lane leaves `big` as it is). */
static inline float round_x_block(const uint16_t *x, int64_t n, int64_t b, int8_t out[32]) {
    if (n - b * 32 >= 32) {
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 w[4], big = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            w[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + b * 32 + 8 * k))), 16));
            big = _mm256_max_ps(_mm256_and_ps(w[k], magnitude), big);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const __m256 inv = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        int32_t q[32];
        for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(q + 8 * k), _mm256_cvtps_epi32(_mm256_mul_ps(w[k], inv)));
        for (int i = 0; i < 32; i++) out[i] = (int8_t)q[i];
        return largest / 127.f;
    }
    float v[32], big = 0.f;
    for (int i = 0; i < 32; i++) {
        v[i] = b * 32 + i < n ? bf16_to_f32(x[b * 32 + i]) : 0.f;
        const float a = v[i] < 0.f ? -v[i] : v[i];
        big = a > big ? a : big;
    }
    const float inv = big > 0.f ? 127.f / big : 0.f;
    for (int i = 0; i < 32; i++) out[i] = (int8_t)rintf(v[i] * inv);
    return big / 127.f;
}
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if defined(__AVX2__)
#include <immintrin.h>
/* The sum of a vector's eight lanes, in the one fixed order every AVX2 tile ends its rows with. */
static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* A tile's work: run the tile of weight rows r0..r0+R against x rows c0..c0+C and store its
 * outputs (ctx: the kernel's own description of the call). */
typedef void (*tile_fn)(const void *ctx, int64_t r0, int R, int64_t c0, int C);

/* The prefetch distance as whole tiles, at least `prefetch` bytes (0: none): a distance inside a
 * row would land in the rows the tile reads beside it, not in the next tile's. */
static inline int64_t whole_tiles(int64_t prefetch, int64_t tile_bytes) {
    return prefetch > 0 ? (prefetch + tile_bytes - 1) / tile_bytes * tile_bytes : 0;
}

/* Every tile of y [m, rows] over the threads: each thread takes a contiguous range of tiles of
 * `tr` weight rows (tile_bytes bytes of w each; the first pf_bytes of its range asked for at once),
 * and each tile runs against the x rows `tc` at a time. One range per thread, one sequential
 * stream each: handed out dynamically, the tiles streamed slower (docs/decode.md). */
static inline void run_tiles(const void *ctx, tile_fn tile, int64_t rows, int64_t m, int64_t tr, int64_t tc, const void *w, int64_t tile_bytes,
                             int64_t pf_bytes) {
    const int64_t units = (rows + tr - 1) / tr;
#pragma omp parallel
    {
        int64_t u0, u1;
        thread_units(units, &u0, &u1);
        prefetch_start((const char *)w + u0 * tile_bytes, min64(pf_bytes, (u1 - u0) * tile_bytes));
        for (int64_t u = u0; u < u1; u++)
            for (int64_t c0 = 0; c0 < m; c0 += tc) tile(ctx, u * tr, (int)min64(tr, rows - u * tr), c0, (int)min64(tc, m - c0));
    }
}

/* Unrolls a tile's loop over its rows or columns before the compiler decides where the tile's
 * accumulators live: unrolled later, they were kept in memory. */
#define UNROLL _Pragma("GCC unroll 4")

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* Up to sixteen of a row's scales from index i, as fp32 (lanes past `count` zero). */
static inline __m512 scales16(const void *s, int64_t kind, int64_t i, int64_t count) {
    __mmask16 m = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
    if (kind == SCALE_F32) return _mm512_maskz_loadu_ps(m, (const float *)s + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)s + i);
    if (kind == SCALE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The group of each 32-bit lane's eight inputs within a 128-input step (lane l: inputs 8l..8l+7),
 * counted from the step's first group: groups of 32, 64, or 128 and more. */
static inline __m512i lane_groups(int64_t group) {
    return group == 32   ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
           : group == 64 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                         : _mm512_setzero_si512();
}
#endif

/* An int8 weight as the Python side describes it once (pocketllm/ops/quant/native.py). */
struct q8_weight {
    const int8_t *w; /* [rows, n] */
    const void *s;   /* [rows], dtype `kind` */
    int64_t kind, rows, n;
};

/* An int4 weight as the Python side describes it once (pocketllm/ops/quant/native.py). */
struct q4_weight {
    const uint8_t *w; /* [rows, n/2] */
    const void *s;    /* [rows, n/group], dtype `kind` */
    int64_t kind;
    const uint8_t *z; /* [rows, n/group], or NULL: zero 8 */
    int64_t rows, n, group;
};

/* Each group's sum of x in fp32, in eight running sums (a loop the compiler vectorizes) added in
 * a fixed order. */
static inline void group_sums(const uint16_t *x, int64_t n, int64_t group, float *xs) {
    for (int64_t g = 0; g < n / group; g++) {
        float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t i = g * group; i < (g + 1) * group; i += 8)
            for (int j = 0; j < 8; j++) t[j] += bf16_to_f32(x[i + j]);
        xs[g] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    }
}
#endif
