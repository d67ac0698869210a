/* Y = X W^T for int8 weights (one scale per row, the layout of gemv_int8.c) and a few bf16 rows X,
 * with each x row first quantized to int8 as gemv_int4_int8x.c does it: blocks of 32 inputs,
 * scale = the block's largest |x| / 127, each input rint(x * 127 / largest). A block's 32 products
 * are then an exact integer sum (AVX2: vpsignb moves each weight's sign onto x, vpmaddubsw then
 * vpmaddwd sum the bytes), converted once and multiplied by the block's scale, where gemv_int8.c's
 * AVX2 tile widens every weight to fp32 and runs out of instructions before a fast memory runs out
 * of bytes. The reference is layout.quant_linear_int8x_reference, which rounds x the same way.
 *
 * One weight row at a time against up to four x rows (AVX2; AVX-512 below): a thread's weight is
 * then one sequential stream, which the hardware prefetchers follow (four rows at a time read four streams, slower on
 * some cores: docs/quantization.md). A row's blocks go alternately into two fp32 sums, so the
 * FMA chain is not what limits one row alone; every (weight row, x row) pair is summed by the same
 * operations in a one-row and a few-row call, so their rows agree bit for bit.
 *
 * With AVX-512 VNNI (and BW, VL) the same sums take 64 weights at a time: vpabsb, x negated under
 * the mask of the negative weights, one vpdpbusd into sixteen int32 lanes (two blocks' eight each),
 * one conversion and one FMA against the two blocks' scales, one sum per pair: a row alone has
 * 64 bytes per FMA's latency, enough. Else AVX2 as above; elsewhere q8x_isa says why not and
 * q8x_gemm returns -2.
 */
#include <stdint.h>

#include "quant.h"

#if defined(INT8X_AVX512) || defined(INT8X_AVX2)
#include <immintrin.h>

#define TILE_C 4

struct q8v {
    const int8_t *w;
    int64_t rows, n;
    const int8_t *xq; /* the x rows' int8 form (quantize_x), xq_bytes(n) apart */
};

#endif

#ifdef INT8X_AVX512
/* One weight row at a time (one stream per thread), or four (q8x_gemm4: each x load serves four
 * weight rows, which pays where the x rows outgrow L1 and costs where they do not: a candidate). */
#define TILE_R 4
const char *q8x_isa(void) { return "avx512_vnni"; }

/* One x row's int8 form, per 64 inputs (zeros past n): the 64 values, then sixteen fp32 scales,
 * the first block's for lanes 0-7 and the second's for 8-15, as vpdpbusd's lanes lie. */
static inline int64_t steps(int64_t n) { return (n + 63) / 64; }
static inline int64_t xq_bytes(int64_t n) { return steps(n) * 128; }

static void quantize_x(const uint16_t *x, int64_t n, int8_t *out) {
    for (int64_t st = 0; st < steps(n); st++) {
        int8_t *o = out + st * 128;
        float *scale = (float *)(o + 64);
        for (int h = 0; h < 2; h++) {
            const float d = round_x_block(x, n, 2 * st + h, o + 32 * h);
            for (int k = 0; k < 8; k++) scale[8 * h + k] = d;
        }
    }
}

static inline __attribute__((always_inline)) void tile(const struct q8v *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const int64_t ns = steps(q->n), xbytes = xq_bytes(q->n);
    const int8_t *xq = q->xq + c0 * xbytes, *w = q->w + r0 * q->n;
    __m512 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t st = 0; st < ns; st++) {
        const int64_t left = q->n - st * 64;
        const __mmask64 in = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i xv[TILE_C];
        __m512 xd[TILE_C];
        UNROLL for (int c = 0; c < C; c++) {
            const int8_t *xs = xq + c * xbytes + st * 128;
            xv[c] = _mm512_loadu_si512((const void *)xs);
            xd[c] = _mm512_loadu_ps((const float *)(xs + 64));
        }
        UNROLL for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_maskz_loadu_epi8(in, w + r * q->n + st * 64);
            const __mmask64 neg = _mm512_movepi8_mask(v);
            const __m512i av = _mm512_abs_epi8(v);
            UNROLL for (int c = 0; c < C; c++) {
                const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), av, _mm512_mask_sub_epi8(xv[c], neg, _mm512_setzero_si512(), xv[c]));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), xd[c], acc[r][c]);
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

#ifdef INT8X_AVX2
#define TILE_R 1
const char *q8x_isa(void) { return "avx2"; }

/* One x row's int8 form: the inputs padded with zeros to whole blocks, then one fp32 scale per
 * block, the whole padded to 64 bytes. */
static inline int64_t blocks(int64_t n) { return (n + 31) / 32; }
static inline int64_t xq_bytes(int64_t n) { return (blocks(n) * 36 + 63) / 64 * 64; }

static void quantize_x(const uint16_t *x, int64_t n, int8_t *out) {
    float *scale = (float *)(out + blocks(n) * 32);
    for (int64_t b = 0; b < blocks(n); b++) scale[b] = round_x_block(x, n, b, out + b * 32);
}

/* Block b of weight row r: 32 bytes, zeros past the row's end (they meet x's zero padding). */
static inline __m256i block(const struct q8v *q, int64_t r, int64_t b) {
    const int8_t *p = q->w + r * q->n + b * 32;
    const int64_t left = q->n - b * 32;
    if (left >= 32) return _mm256_loadu_si256((const __m256i *)p);
    int8_t tail[32] = {0};
    memcpy(tail, p, (size_t)left);
    return _mm256_loadu_si256((const __m256i *)tail);
}

/* The exact integer products of one block: weight v against x bytes xv, eight int32 lanes. */
static inline __m256 block_sum(__m256i v, __m256i xv) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xv, v)), _mm256_set1_epi16(1)));
}

/* Blocks b and b + 1 of a weight row (v0, v1) against C x rows into their sums a0 and a1. */
static inline __attribute__((always_inline)) void block_pair(const int8_t *xq, int64_t xbytes, int64_t nb, int C, int64_t b, __m256i v0, __m256i v1,
                                                             __m256 *a0, __m256 *a1) {
    UNROLL for (int c = 0; c < C; c++) {
        const int8_t *xs = xq + c * xbytes;
        const float *d = (const float *)(xs + nb * 32) + b;
        a0[c] = _mm256_fmadd_ps(block_sum(v0, _mm256_loadu_si256((const __m256i *)(xs + b * 32))), _mm256_broadcast_ss(d), a0[c]);
        a1[c] = _mm256_fmadd_ps(block_sum(v1, _mm256_loadu_si256((const __m256i *)(xs + b * 32 + 32))), _mm256_broadcast_ss(d + 1), a1[c]);
    }
}

/* Weight row r against x rows c0.. (C of them) over blocks b0..b1, each x row's two sums carried in
 * acc (a0's eight floats, then a1's) from one range of blocks to the next. Blocks go alternately
 * into a0 and a1 counting from block 0, so ranges that start at even blocks sum every block where
 * the whole row does; an odd last block goes into a0. pf > 0: each 64 bytes of the row also asked
 * for into L2 pf bytes ahead (the blocked form's next rows). */
static inline __attribute__((always_inline)) void tile_acc(const struct q8v *q, int64_t r, int64_t c0, int C, int64_t b0, int64_t b1, float *acc, int64_t pf) {
    const int64_t nb = blocks(q->n), xbytes = xq_bytes(q->n);
    const int8_t *xq = q->xq + c0 * xbytes, *wr = q->w + r * q->n;
    __m256 a0[TILE_C], a1[TILE_C];
    UNROLL for (int c = 0; c < C; c++) a0[c] = _mm256_loadu_ps(acc + 16 * c), a1[c] = _mm256_loadu_ps(acc + 16 * c + 8);
    int64_t b = b0;
    /* Block pairs wholly inside the row load as they are; block() pads the row's last part. */
    for (const int64_t whole = min64(b1, q->n / 32); b + 2 <= whole; b += 2) {
        if (pf) prefetch_weight((const char *)(wr + b * 32) + pf, PF_L2);
        block_pair(xq, xbytes, nb, C, b, _mm256_loadu_si256((const __m256i *)(wr + b * 32)), _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32)), a0, a1);
    }
    for (; b + 2 <= b1; b += 2) {
        if (pf) prefetch_weight((const char *)(wr + b * 32) + pf, PF_L2);
        block_pair(xq, xbytes, nb, C, b, block(q, r, b), block(q, r, b + 1), a0, a1);
    }
    if (b < b1) { /* an odd last block goes into the first sum */
        const __m256i v0 = block(q, r, b);
        UNROLL for (int c = 0; c < C; c++) {
            const int8_t *xs = xq + c * xbytes;
            a0[c] = _mm256_fmadd_ps(block_sum(v0, _mm256_loadu_si256((const __m256i *)(xs + b * 32))), _mm256_broadcast_ss((const float *)(xs + nb * 32) + b), a0[c]);
        }
    }
    UNROLL for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + 16 * c, a0[c]), _mm256_storeu_ps(acc + 16 * c + 8, a1[c]);
}

static inline float finish_pair(const float *acc) { return hsum8(_mm256_add_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8))); }

static inline __attribute__((always_inline)) void tile(const struct q8v *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    (void)R;
    float acc[16 * TILE_C] = {0};
    tile_acc(q, r0, c0, C, 0, blocks(q->n), acc, 0);
    UNROLL for (int c = 0; c < C; c++) o[0][c] = finish_pair(acc + 16 * c);
}
#define HAS_BLOCKED 1
#endif

#if defined(INT8X_AVX512) || defined(INT8X_AVX2)

#define TILE_Q struct q8v
#include "run_tile.h"
#undef TILE_Q

/* Tile (r0, c0) of q8x_gemm's call: its outputs times their row's scale. */
struct q8x_call {
    struct q8v q;
    const struct q8_weight *wt;
    uint16_t *y;
};
static void q8x_tile(const void *ctx, int64_t r0, int R, int64_t c0, int C) {
    const struct q8x_call *k = ctx;
    float o[TILE_R][TILE_C];
    run_tile(&k->q, r0, c0, R, C, o);
    UNROLL for (int r = 0; r < R; r++) {
        const float s = scale_at(k->wt->s, k->wt->kind, r0 + r);
        UNROLL for (int c = 0; c < C; c++) k->y[(c0 + c) * k->wt->rows + r0 + r] = f32_to_bf16(o[r][c] * s);
    }
}

/* x's m rows in their int8 form (quantize_x), xq_bytes(n) apart, in the per-thread scratch with
 * `extra` bytes after them at quantized_bytes(n, m), 64-byte aligned; NULL when it cannot grow. */
static inline size_t quantized_bytes(int64_t n, int64_t m) { return ((size_t)(m * xq_bytes(n)) + 63) / 64 * 64; }
static int8_t *quantized_rows(const uint16_t *x, int64_t n, int64_t m, size_t extra) {
    int8_t *xq = scratch(quantized_bytes(n, m) + extra);
    if (xq != NULL)
        for (int64_t c = 0; c < m; c++) quantize_x(x + c * n, n, xq + c * xq_bytes(n));
    return xq;
}

static int q8x_run(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t tr) {
    const int64_t rows = wt->rows, n = wt->n;
    int8_t *xq = quantized_rows(x, n, m, 0);
    if (xq == NULL) return -1;
    struct q8x_call k = {{wt->w, rows, n, xq}, wt, y};
    run_tiles(&k, q8x_tile, rows, m, tr, TILE_C, wt->w, tr * n, 0);
    return 0;
}

/* y [m, rows] = x [m, n] W^T, row r scaled by s[r], one weight row at a time. prefetch and where
 * are q8_gemm's arguments, unused: a single stream per thread is what the hardware prefetchers
 * follow, and a software prefetch on top measured slower. Returns 0, or -1 when x's scratch could
 * not be allocated (nothing written). */
int q8x_gemm(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)prefetch, (void)where;
    return q8x_run(wt, x, y, m, 1);
}

/* q8x_gemm blocked for the caches, where the build has it (AVX2): at the 27B's widths four x rows'
 * int8 form (70 KiB at 17408 inputs) leave L1 between weight rows, so each row read x from L2.
 * Here each thread takes its rows BLOCKED_ROWS at a time against BLOCKED_X_BYTES of the x rows'
 * inputs at a time (whole pairs of blocks), each pair's two sums carried from one range of
 * inputs to the next (tile_acc: the same bits as q8x_gemm), and meanwhile asks for the next
 * rows into L2. Returns 0, -1 when its buffers could not be allocated (nothing written), -2
 * where the build has no such form. The block sizes are the bf16 c-blocked's (ops/gemv/kernels.py
 * BLOCKED_X_BYTES, BLOCKED_ROWS), fixed here: a quantized kernel's arguments past m are
 * prefetch and where, as the compiled decode step calls every one of them. */
#define BLOCKED_ROWS 32
#define BLOCKED_X_BYTES 16384
int q8x_gemm_blocked(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)prefetch, (void)where;
#ifdef HAS_BLOCKED
    const int64_t rows = wt->rows, n = wt->n, nb = blocks(n);
    int64_t kb = BLOCKED_X_BYTES / (m * 32) / 2 * 2;
    if (kb < 2) kb = 2;
    const int threads = max_threads();
    const int64_t per = BLOCKED_ROWS * m * 16; /* floats of sums per thread */
    int8_t *xq = quantized_rows(x, n, m, (size_t)(per * threads) * sizeof(float));
    if (xq == NULL) return -1;
    float *sums = (float *)(xq + quantized_bytes(n, m));
    const struct q8v q = {wt->w, rows, n, xq};
#pragma omp parallel num_threads(threads)
    {
        int64_t r0, r1;
        thread_units(rows, &r0, &r1);
        float *acc = sums + thread_index() * per;
        for (int64_t g0 = r0; g0 < r1; g0 += BLOCKED_ROWS) {
            const int64_t ge = min64(g0 + BLOCKED_ROWS, r1);
            memset(acc, 0, (size_t)((ge - g0) * m * 16) * sizeof(float));
            for (int64_t k0 = 0; k0 < nb; k0 += kb) {
                const int64_t k1 = min64(k0 + kb, nb);
                for (int64_t c0 = 0; c0 < m; c0 += TILE_C) {
                    const int C = (int)min64(TILE_C, m - c0);
                    /* The first pass over these rows' inputs reads memory: it asks for the next rows. */
                    const int64_t pf = c0 == 0 ? (ge - g0) * n : 0;
                    for (int64_t r = g0; r < ge; r++) {
                        float *a = acc + ((r - g0) * m + c0) * 16;
                        /* Constant x-row counts, so the sums stay in registers. */
                        switch (C) {
                        case 4: tile_acc(&q, r, c0, 4, k0, k1, a, pf); break;
                        case 3: tile_acc(&q, r, c0, 3, k0, k1, a, pf); break;
                        case 2: tile_acc(&q, r, c0, 2, k0, k1, a, pf); break;
                        default: tile_acc(&q, r, c0, 1, k0, k1, a, pf); break;
                        }
                    }
                }
            }
            for (int64_t r = g0; r < ge; r++) {
                const float s = scale_at(wt->s, wt->kind, r);
                for (int64_t c = 0; c < m; c++) y[c * rows + r] = f32_to_bf16(finish_pair(acc + ((r - g0) * m + c) * 16) * s);
            }
        }
    }
    return 0;
#else
    (void)wt, (void)x, (void)y, (void)m;
    return -2;
#endif
}

/* Whether the build has q8x_gemm_blocked's form (AVX2). */
int q8x_has_blocked(void) {
#ifdef HAS_BLOCKED
    return 1;
#else
    return 0;
#endif
}

/* The weight rows the build's tile takes at a time (q8x_gemm4 needs four). */
int q8x_tile_rows(void) { return TILE_R; }

/* The same four weight rows at a time where the build has that tile (AVX-512 VNNI); -2 elsewhere.
 * Each output's bits are q8x_gemm's. */
int q8x_gemm4(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)prefetch, (void)where;
    return TILE_R >= 4 ? q8x_run(wt, x, y, m, 4) : -2;
}

#else
const char *q8x_isa(void) { return "unavailable: the CPU (or the compiler) has neither AVX-512 VNNI nor AVX2"; }
int q8x_gemm(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)wt, (void)x, (void)y, (void)m, (void)prefetch, (void)where;
    return -2;
}
int q8x_gemm4(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    return q8x_gemm(wt, x, y, m, prefetch, where);
}
int q8x_tile_rows(void) { return 0; }
int q8x_has_blocked(void) { return 0; }
int q8x_gemm_blocked(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    return q8x_gemm(wt, x, y, m, prefetch, where);
}
#endif
