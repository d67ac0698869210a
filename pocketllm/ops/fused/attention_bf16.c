/* Gated attention of one bf16 decode row over a paged KV cache, from its fused q|k|v projection to
 * the input of o_proj (pocketllm/ops/fused/reference.py: attention_decode_reference).
 *
 * At a long context the cache read is the work, so it is split the way flash-decoding splits it:
 * the sequence's blocks are cut into `splits` ranges, one per thread of an OpenMP loop over
 * torch's threads. A range streams each of its K and V blocks once for all the query heads that
 * read that KV head (GQA), keeping per query head a running max, sum and fp32 accumulator (online
 * softmax, a block at a time); the ranges' partials are then merged with their log-sum-exp. A
 * range takes every KV head of a block in turn (they lie side by side in the pool), so each
 * thread reads its part of each pool front to back: split by KV head instead, two threads read
 * every other 16 KiB of the pool, and the cache read was the slower (docs/measuring.md, figures
 * behind the code's choices). Scratch is fixed per call (attention_decode_work_floats), whatever
 * the context.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rounding.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The cache lines of one row of d bf16, fetched ahead of their use: the rows of the block read
 * next are spread over the current block's work, one row per row. Without it the cores wait on
 * each block's first lines (the blocks of a head are 16-32 KiB apart in the pool), which slows
 * the cache read (docs/measuring.md, figures behind the code's choices). */
static inline void prefetch_row(const uint16_t *row, int64_t d) {
    for (int64_t off = 0; off < d * 2; off += 64) __builtin_prefetch((const char *)row + off, 0, 3);
}

/* Each ISA section defines:
 *   PAD: a query head's prepared q and accumulator take d rounded up to PAD floats;
 *   acc_index(e): where dim e of an accumulator is kept (each ACC_CHUNK dims: even ones, then odd);
 *   prep_q(q, d, qp): q [d] fp32 (bf16 values) into the form dot_rows reads;
 *   dot_rows(k, n, d, qp, s, pf): s[o] = q . k[o] for n rows of d bf16;
 *   max_rows(s, n): the largest of s[0..n);
 *   exp_rows(s, n, scale, m): s[o] = exp(s[o] * scale - m), returning their sum;
 *   add_group(v, n, d, p, ps, acc, as, cnt, pf): acc_j[acc_index(e)] += sum_o p[j * ps + o] v[o][e]
 *     for the cnt <= 4 accumulators acc_j = acc + j * as.
 * dot_rows and add_group prefetch pf's rows (NULL: none) as they go. */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAD 64
#define ACC_CHUNK 32
static inline __m512 exp512(__m512 x) {
    /* exp(x) = 2^n exp(r), |r| <= ln2 / 2, exp(r) by a degree-7 polynomial (about 1 ulp). */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
static inline __mmask16 mask16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u); }
static inline __mmask32 mask32(int64_t left) { return left >= 32 ? (__mmask32)~0u : left <= 0 ? 0 : (__mmask32)((1u << left) - 1u); }
/* 32 bf16 as two fp32 vectors without a cross-lane widening: each 32-bit lane shifted left by 16
 * is its even element, masked to its high half its odd one. */
static inline __m512 even16(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 odd16(__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))); }
static float max_rows(const float *s, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t o = 0; o < n; o += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask16(n - o), s + o));
    return _mm512_reduce_max_ps(top);
}
static float exp_rows(float *s, int64_t n, float scale, float m) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t o = 0; o < n; o += 16) {
        __mmask16 k = mask16(n - o);
        __m512 p = _mm512_maskz_mov_ps(k, exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + o), _mm512_set1_ps(scale), _mm512_set1_ps(m))));
        _mm512_mask_storeu_ps(s + o, k, p);
        sum = _mm512_add_ps(sum, p);
    }
    return _mm512_reduce_add_ps(sum);
}
/* Up to four query heads' accumulators in registers, 64 dims a pass (sixteen independent sums, so
 * a multiply-add's latency is hidden), over every row: each V load feeds 4 * cnt multiply-adds.
 * Inlined with a constant cnt. */
static inline __attribute__((always_inline)) void add_group(const uint16_t *v, int64_t n, int64_t d, const float *p, int64_t ps, float *acc, int64_t as, int cnt,
                                                            const uint16_t *pf) {
    for (int64_t e = 0; e < d; e += 64) {
        const __mmask32 m0 = mask32(d - e), m1 = mask32(d - e - 32);
        __m512 a[4][4];
        for (int j = 0; j < cnt; j++)
            for (int c = 0; c < 4; c++) a[j][c] = _mm512_loadu_ps(acc + j * as + e + 16 * c);
        for (int64_t o = 0; o < n; o++) {
            if (pf != NULL && e == 0) prefetch_row(pf + o * d, d);
            const __m512i x0 = _mm512_maskz_loadu_epi16(m0, v + o * d + e), x1 = _mm512_maskz_loadu_epi16(m1, v + o * d + e + 32);
            const __m512 x[4] = {even16(x0), odd16(x0), even16(x1), odd16(x1)};
            for (int j = 0; j < cnt; j++) {
                const __m512 pj = _mm512_set1_ps(p[j * ps + o]);
                for (int c = 0; c < 4; c++) a[j][c] = _mm512_fmadd_ps(pj, x[c], a[j][c]);
            }
        }
        for (int j = 0; j < cnt; j++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + j * as + e + 16 * c, a[j][c]);
    }
}
/* The sum of a vector's two 256-bit halves. */
static inline __m256 fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define PAD 16
#define ACC_CHUNK 16
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n built in the exponent field; n >= -126 after the clamp above. */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Sixteen bf16 as two fp32 vectors: even elements by a shift, odd ones by a mask. */
static inline __m256 even_f(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd_f(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
/* Sixteen bf16 from p, of which `left` (< 16) are there and the rest read as zero. */
static inline __m256i load16_tail(const uint16_t *p, int64_t left) {
    uint16_t buf[16] = {0};
    memcpy(buf, p, (size_t)left * 2);
    return _mm256_loadu_si256((const __m256i *)buf);
}
static float max_rows(const float *s, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + o));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; o < n; o++) m = s[o] > m ? s[o] : m;
    return m;
}
static float exp_rows(float *s, int64_t n, float scale, float m) {
    __m256 sum = _mm256_setzero_ps();
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) {
        __m256 p = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(s + o), _mm256_set1_ps(scale), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + o, p);
        sum = _mm256_add_ps(sum, p);
    }
    float total = hsum256(sum);
    for (; o < n; o++) total += (s[o] = expf(s[o] * scale - m));
    return total;
}
/* As the AVX-512 form, 16 dims a pass (eight sums for four heads in sixteen registers). */
static inline __attribute__((always_inline)) void add_group(const uint16_t *v, int64_t n, int64_t d, const float *p, int64_t ps, float *acc, int64_t as, int cnt,
                                                            const uint16_t *pf) {
    for (int64_t e = 0; e < d; e += 16) {
        __m256 a[4][2];
        for (int j = 0; j < cnt; j++)
            for (int c = 0; c < 2; c++) a[j][c] = _mm256_loadu_ps(acc + j * as + e + 8 * c);
        for (int64_t o = 0; o < n; o++) {
            if (pf != NULL && e == 0) prefetch_row(pf + o * d, d);
            const __m256i x = e + 16 <= d ? _mm256_loadu_si256((const __m256i *)(v + o * d + e)) : load16_tail(v + o * d + e, d - e);
            const __m256 xe = even_f(x), xo = odd_f(x);
            for (int j = 0; j < cnt; j++) {
                const __m256 pj = _mm256_set1_ps(p[j * ps + o]);
                a[j][0] = _mm256_fmadd_ps(pj, xe, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(pj, xo, a[j][1]);
            }
        }
        for (int j = 0; j < cnt; j++)
            for (int c = 0; c < 2; c++) _mm256_storeu_ps(acc + j * as + e + 8 * c, a[j][c]);
    }
}
#else
#define PAD 1
#define ACC_CHUNK 1
static float max_rows(const float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t o = 0; o < n; o++) m = s[o] > m ? s[o] : m;
    return m;
}
static float exp_rows(float *s, int64_t n, float scale, float m) {
    float total = 0.0f;
    for (int64_t o = 0; o < n; o++) total += (s[o] = expf(s[o] * scale - m));
    return total;
}
static inline void add_group(const uint16_t *v, int64_t n, int64_t d, const float *p, int64_t ps, float *acc, int64_t as, int cnt, const uint16_t *pf) {
    (void)pf;
    for (int j = 0; j < cnt; j++)
        for (int64_t o = 0; o < n; o++)
            for (int64_t e = 0; e < d; e++) acc[j * as + e] += p[j * ps + o] * bf(v[o * d + e]);
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
/* Lane r of the result: the sum of v[r]'s eight lanes. */
static inline __m256 sum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* q holds bf16 values (rounded after the rotation), so it is kept as bf16 and each product of the
 * dot product is exact in fp32, as in the other paths. */
static void prep_q(const float *q, int64_t d, float *qp) {
    uint16_t *h = (uint16_t *)qp;
    for (int64_t i = 0; i < d; i++) h[i] = to_bf(q[i]);
}
static inline __m512bh load_bh(const uint16_t *p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
static void dot_rows(const uint16_t *k, int64_t n, int64_t d, const float *qp, float *s, const uint16_t *pf) {
    const uint16_t *q = (const uint16_t *)qp;
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) {
        if (pf != NULL)
            for (int r = 0; r < 8; r++) prefetch_row(pf + (o + r) * d, d);
        __m512 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32) {
            __mmask32 m = mask32(d - i);
            __m512bh qv = load_bh(q + i, m);
            for (int r = 0; r < 8; r++) a[r] = _mm512_dpbf16_ps(a[r], load_bh(k + (o + r) * d + i, m), qv);
        }
        _mm256_storeu_ps(s + o, sum8(fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]), fold(a[4]), fold(a[5]), fold(a[6]), fold(a[7])));
    }
    for (; o < n; o++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32) a = _mm512_dpbf16_ps(a, load_bh(k + o * d + i, mask32(d - i)), load_bh(q + i, mask32(d - i)));
        s[o] = _mm512_reduce_add_ps(a);
    }
}
#elif defined(__AVX512F__) && defined(__AVX512BW__)
/* q split per 32 dims into its 16 even and 16 odd ones, as each K load is split (zero beyond d). */
static void prep_q(const float *q, int64_t d, float *qp) {
    for (int64_t i = 0; i < (d + 31) / 32 * 32; i++) qp[(i / 32) * 32 + (i & 1) * 16 + (i % 32) / 2] = i < d ? q[i] : 0.0f;
}
static void dot_rows(const uint16_t *k, int64_t n, int64_t d, const float *q, float *s, const uint16_t *pf) {
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) {
        if (pf != NULL)
            for (int r = 0; r < 8; r++) prefetch_row(pf + (o + r) * d, d);
        __m512 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32) {
            const __mmask32 m = mask32(d - i);
            const __m512 qe = _mm512_loadu_ps(q + i), qo = _mm512_loadu_ps(q + i + 16);
            for (int r = 0; r < 8; r++) {
                const __m512i kv = _mm512_maskz_loadu_epi16(m, k + (o + r) * d + i);
                a[r] = _mm512_fmadd_ps(odd16(kv), qo, _mm512_fmadd_ps(even16(kv), qe, a[r]));
            }
        }
        _mm256_storeu_ps(s + o, sum8(fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]), fold(a[4]), fold(a[5]), fold(a[6]), fold(a[7])));
    }
    for (; o < n; o++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32) {
            const __m512i kv = _mm512_maskz_loadu_epi16(mask32(d - i), k + o * d + i);
            a = _mm512_fmadd_ps(odd16(kv), _mm512_loadu_ps(q + i + 16), _mm512_fmadd_ps(even16(kv), _mm512_loadu_ps(q + i), a));
        }
        s[o] = _mm512_reduce_add_ps(a);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* q split per 16 dims into its 8 even and 8 odd ones, as each K load is split (zero beyond d). */
static void prep_q(const float *q, int64_t d, float *qp) {
    for (int64_t i = 0; i < (d + 15) / 16 * 16; i++) qp[(i / 16) * 16 + (i & 1) * 8 + (i % 16) / 2] = i < d ? q[i] : 0.0f;
}
static inline __m256i k_load(const uint16_t *p, int64_t left) {
    return left >= 16 ? _mm256_loadu_si256((const __m256i *)p) : load16_tail(p, left);
}
static void dot_rows(const uint16_t *k, int64_t n, int64_t d, const float *q, float *s, const uint16_t *pf) {
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) {
        if (pf != NULL)
            for (int r = 0; r < 8; r++) prefetch_row(pf + (o + r) * d, d);
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m256 qe = _mm256_loadu_ps(q + i), qo = _mm256_loadu_ps(q + i + 8);
            for (int r = 0; r < 8; r++) {
                const __m256i kv = k_load(k + (o + r) * d + i, d - i);
                a[r] = _mm256_fmadd_ps(odd_f(kv), qo, _mm256_fmadd_ps(even_f(kv), qe, a[r]));
            }
        }
        _mm256_storeu_ps(s + o, sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    }
    for (; o < n; o++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m256i kv = k_load(k + o * d + i, d - i);
            a = _mm256_fmadd_ps(odd_f(kv), _mm256_loadu_ps(q + i + 8), _mm256_fmadd_ps(even_f(kv), _mm256_loadu_ps(q + i), a));
        }
        s[o] = hsum256(a);
    }
}
#else
static void prep_q(const float *q, int64_t d, float *qp) {
    for (int64_t i = 0; i < d; i++) qp[i] = q[i];
}
static void dot_rows(const uint16_t *k, int64_t n, int64_t d, const float *q, float *s, const uint16_t *pf) {
    (void)pf;
    for (int64_t o = 0; o < n; o++) {
        float t = 0.0f;
        for (int64_t i = 0; i < d; i++) t += q[i] * bf(k[o * d + i]);
        s[o] = t;
    }
}
#endif

static inline int64_t padded(int64_t d) { return (d + PAD - 1) / PAD * PAD; }

static inline int64_t acc_index(int64_t e) { return ACC_CHUNK == 1 ? e : (e / ACC_CHUNK) * ACC_CHUNK + (e & 1) * (ACC_CHUNK / 2) + (e % ACC_CHUNK) / 2; }

static void add_rows(const uint16_t *v, int64_t n, int64_t d, const float *p, int64_t ps, int64_t g, float *acc, int64_t as, const uint16_t *pf) {
    for (int64_t j = 0; j < g; j += 4) {
        /* The next rows are prefetched once, with the first heads. */
        const uint16_t *f = j == 0 ? pf : NULL;
        switch (g - j < 4 ? g - j : 4) {
        case 4: add_group(v, n, d, p + j * ps, ps, acc + j * as, as, 4, f); break;
        case 3: add_group(v, n, d, p + j * ps, ps, acc + j * as, as, 3, f); break;
        case 2: add_group(v, n, d, p + j * ps, ps, acc + j * as, as, 2, f); break;
        default: add_group(v, n, d, p + j * ps, ps, acc + j * as, as, 1, f); break;
        }
    }
}

/* One item: every query head over blocks b0..b1-1 of the table, of a cache of s_len positions, a
 * block at a time and in it one KV head after another, so that the item reads its range of each
 * pool front to back. part: per query head pw floats, [m, l, acc]; s: scratch of group * bs floats. */
static void attend_blocks(const float *qp, const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *table, int64_t bs, int64_t s_len,
                          int64_t kvh, int64_t d, int64_t group, float scale, int64_t b0, int64_t b1, float *part, int64_t pw, float *s) {
    for (int64_t j = 0; j < kvh * group; j++) {
        float *pj = part + j * pw;
        pj[0] = -INFINITY, pj[1] = 0.0f;
        for (int64_t e = 2; e < pw; e++) pj[e] = 0.0f;
    }
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n = s_len - b * bs < bs ? s_len - b * bs : bs;
        for (int64_t kh = 0; kh < kvh; kh++) {
            const int64_t base = ((int64_t)table[b] * kvh + kh) * bs * d;
            /* While K is read, V of this head is fetched; while V is read, K of the next. */
            const uint16_t *next_k = kh + 1 < kvh ? k_pool + base + bs * d : b + 1 < b1 ? k_pool + (int64_t)table[b + 1] * kvh * bs * d : NULL;
            float *ph = part + kh * group * pw;
            for (int64_t j = 0; j < group; j++) dot_rows(k_pool + base, n, d, qp + (kh * group + j) * padded(d), s + j * bs, j == 0 ? v_pool + base : NULL);
            for (int64_t j = 0; j < group; j++) {
                float *pj = ph + j * pw, *sj = s + j * bs;
                const float top = max_rows(sj, n) * scale, m = pj[0] > top ? pj[0] : top;
                if (m != pj[0]) {
                    /* The running sum and accumulator were taken against the old max. */
                    const float f = expf(pj[0] - m);
                    for (int64_t e = 1; e < pw; e++) pj[e] *= f;
                    pj[0] = m;
                }
                pj[1] += exp_rows(sj, n, scale, m);
            }
            add_rows(v_pool + base, n, d, s, bs, group, ph + 2, pw, next_k);
        }
    }
}

/* Floats of scratch attention_decode_bf16 takes for these sizes and up to `splits` ranges of
 * blocks: independent of the context length. */
int64_t attention_decode_work_floats(int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t splits) {
    return heads * d + heads * padded(d) + kvh * d + splits * (heads * (padded(d) + 2) + heads / kvh * bs);
}

/* qkv: [H*2d (query and gate interleaved per head) | kvh*d | kvh*d] bf16; q_scale, k_scale: [d]
 * fp32 (1 + w of q_norm, k_norm); cos, sin: [half] fp32 for this position; k_pool, v_pool:
 * [blocks, kvh, bs, d] bf16, the layer's KV blocks; table: the sequence's block ids (position t
 * is row t % bs of block table[t / bs]), row pos written here; out: [H*d] bf16; work:
 * attention_decode_work_floats(heads, kvh, d, bs, splits) floats; splits: ranges of blocks (at
 * most one per block; 1 runs the whole call on the calling thread). Returns 0, or -1 without
 * touching anything when the table names a block outside the pool's `blocks`. */
int attention_decode_bf16(const uint16_t *qkv, const float *q_scale, const float *k_scale, float eps, const float *cos, const float *sin,
                          uint16_t *k_pool, uint16_t *v_pool, int64_t blocks, const int32_t *table, int64_t bs, int64_t pos, int64_t heads,
                          int64_t kvh, int64_t d, int64_t half, float scale, uint16_t *out, float *work, int64_t splits) {
    const int64_t s_len = pos + 1, group = heads / kvh, nblocks = pos / bs + 1, qw = padded(d);
    for (int64_t b = 0; b < nblocks; b++)
        if (table[b] < 0 || table[b] >= blocks) return -1;
    const uint16_t *kp = qkv + heads * 2 * d, *vp = kp + kvh * d;
    float *q = work, *qp = q + heads * d, *k = qp + heads * qw, *parts = k + kvh * d;
    /* Per head: zero-centred RMSNorm (rounded), then the rotation of the first 2*half dims in
     * fp32 (rounded). */
    for (int64_t h = 0; h < heads + kvh; h++) {
        const uint16_t *src = h < heads ? qkv + h * 2 * d : kp + (h - heads) * d;
        const float *sc = h < heads ? q_scale : k_scale;
        float *x = h < heads ? q + h * d : k + (h - heads) * d;
        for (int64_t i = 0; i < d; i++) x[i] = bf(src[i]);
        float r = inv_rms(x, d, eps);
        for (int64_t i = 0; i < d; i++) x[i] = rbf(x[i] * r * sc[i]);
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[half + i];
            x[i] = rbf(x1 * cos[i] - x2 * sin[i]);
            x[half + i] = rbf(x2 * cos[i] + x1 * sin[i]);
        }
        if (h < heads) prep_q(x, d, qp + h * qw);
    }
    const int64_t last = ((int64_t)table[pos / bs] * kvh * bs + pos % bs) * d;
    for (int64_t h = 0; h < kvh; h++)
        for (int64_t i = 0; i < d; i++) {
            k_pool[last + h * bs * d + i] = to_bf(k[h * d + i]);
            v_pool[last + h * bs * d + i] = vp[h * d + i];
        }
    if (splits < 1) splits = 1;
    if (splits > nblocks) splits = nblocks;
    /* Blocks per range; ranges recounted so that none is empty. */
    const int64_t per = (nblocks + splits - 1) / splits;
    splits = (nblocks + per - 1) / per;
    const int64_t pw = qw + 2;
    float *scratch = parts + splits * heads * pw;
#pragma omp parallel for schedule(static) if (splits > 1)
    for (int64_t sp = 0; sp < splits; sp++) {
        const int64_t b0 = sp * per, b1 = b0 + per < nblocks ? b0 + per : nblocks;
        attend_blocks(qp, k_pool, v_pool, table, bs, s_len, kvh, d, group, scale, b0, b1, parts + sp * heads * pw, pw, scratch + sp * group * bs);
    }
    /* Merge each query head's ranges by their log-sum-exp, then the output gate. */
    for (int64_t h = 0; h < heads; h++) {
        float top = -INFINITY;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float m = parts[(sp * heads + h) * pw];
            top = m > top ? m : top;
        }
        float *acc = q + h * d, total = 0.0f;
        for (int64_t e = 0; e < d; e++) acc[e] = 0.0f;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float *pj = parts + (sp * heads + h) * pw;
            const float f = expf(pj[0] - top);
            total += f * pj[1];
            for (int64_t e = 0; e < d; e++) acc[e] += f * pj[2 + acc_index(e)];
        }
        const uint16_t *gate = qkv + h * 2 * d + d;
        for (int64_t e = 0; e < d; e++) out[h * d + e] = to_bf(rbf(acc[e] / total) * rbf(sigmoid(bf(gate[e]))));
    }
    return 0;
}
