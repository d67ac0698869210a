/* Y = X W^T for int8 weights and a few bf16 rows X [m, n] (m = 1: a decode step's GEMV), Y bf16
 * [m, rows]. W is the layout of pocketllm/ops/quant/layout.py: int8 [rows, n], one scale per row
 * (bf16, fp16 or fp32 as stored).
 *
 * As gemv_int4.c: weight rows go TILE_R at a time against TILE_C x rows, each weight is widened
 * once per tile, a row's products are summed in fp32 and multiplied by its scale once, each output
 * is rounded to bf16 once, and every (weight row, x row) pair is summed by the same sequence of
 * operations whatever the tile around it, so a row of a few-row call equals the one-row call bit
 * for bit. Built with -march=native: AVX-512 BF16 dot products on each weight read as two exact bf16
 * values (its nibbles, see below), else AVX-512 FMAs on weights widened to fp32 (a CPU with
 * AVX-512 but not its BF16 part: Skylake-X, Cascade Lake, Ice Lake), else AVX2 FMAs on weights
 * widened to fp32, else plain C.
 */
#include <stdint.h>

#include "quant.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

struct q8 {
    const int8_t *w;
    int64_t rows, n;
    int64_t pf_bytes; /* how far ahead of each weight load its prefetch reaches (0: none) */
    int64_t pf_where;  /* where that prefetch puts the lines (quant.h prefetch_weight) */
    const void *x; /* the x rows as the tile reads them */
    int64_t xstride; /* elements between two of them */
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 64 weights at a time, with no widening: 64 bytes load as 32 words, and each byte's two nibbles
 * become bf16 values exactly by or-ing them into an exponent, as gemv_int4.c does. A weight
 * q = 16 h + l (h its signed high nibble, l its low one) is read as two values: 128 + l (the low
 * nibble in the exponent of 128, whose bf16 step is 1) and 2048 + 16 (h + 8) (the high nibble,
 * its sign bit flipped, in the exponent of 2048, whose step is 16); together q + 2304. x is laid
 * out once per call to match (per 64 inputs, its even elements then its odd ones), and each dot
 * product lane starts from -2304 times its four inputs' sum of x (made per call by the same
 * instruction), so what it holds is the sum of q x, in fp32. Four bf16 dot products per 64
 * weights, where widening through 32-bit integers and fp32 took eight instructions per 32 and
 * ran out of them before memory. The offset costs some fp32 bits of each 64 inputs' sum, far
 * below the output's bf16 rounding. */
#define TILE_R 4
#define TILE_C 4
#define X_ELEM uint16_t
const char *q8_isa(void) { return "avx512_bf16"; }

/* Per x row and 64 inputs (n rounded up): 32 even inputs, 32 odd ones, 16 fp32 starting values. */
static int64_t x_stride(int64_t n) {
    int64_t npad = (n + 63) & ~(int64_t)63;
    return npad + npad / 2;
}
static void prepare_x(const uint16_t *x, int64_t n, uint16_t *xp) {
    const __m512i two_j = _mm512_slli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                                             13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    const __m512i odd = _mm512_add_epi16(two_j, _mm512_set1_epi16(1));
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int64_t b = 0, o = 0; b < n; b += 64, o += 96) {
        int64_t left0 = n - b, left1 = n - b - 32;
        __mmask32 m0 = left0 >= 32 ? (__mmask32)~0u : (__mmask32)((1u << left0) - 1u);
        __mmask32 m1 = left1 >= 32 ? (__mmask32)~0u : left1 <= 0 ? 0 : (__mmask32)((1u << left1) - 1u);
        __m512i in0 = _mm512_maskz_loadu_epi16(m0, x + b), in1 = _mm512_maskz_loadu_epi16(m1, x + b + 32);
        __m512i xe = _mm512_permutex2var_epi16(in0, two_j, in1), xo = _mm512_permutex2var_epi16(in0, odd, in1);
        _mm512_storeu_si512(xp + o, xe);
        _mm512_storeu_si512(xp + o + 32, xo);
        /* Lane l of a dot product pairs words 2l and 2l + 1: inputs 4l..4l+3 over the two runs. */
        __m512 sum = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xe, ones), (__m512bh)xo, ones);
        _mm512_storeu_ps((float *)(xp + o + 64), _mm512_mul_ps(sum, _mm512_set1_ps(-2304.f)));
    }
}

static inline __attribute__((always_inline)) void tile(const struct q8 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const __m512i low = _mm512_set1_epi16(0x0f), exp128 = _mm512_set1_epi16(0x4300), exp2048_flip = _mm512_set1_epi16(0x4508);
    const uint16_t *x = (const uint16_t *)q->x + c0 * q->xstride;
    __m512 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    /* As gemv_int4.c: the weight prefetch reaches pf_bytes (whole tiles) ahead, none past the weight's end. */
    const int64_t pf = (r0 + R) * q->n + q->pf_bytes <= q->rows * q->n ? q->pf_bytes : 0;
    for (int64_t e = 0, xo = 0; e < q->n; e += 64, xo += 96) {
        /* A row that ends inside the step loads zeros past its end, which meet x's zero padding. */
        __mmask64 m = q->n - e >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (q->n - e)) - 1);
        __m512bh nib[TILE_R][4];
        UNROLL for (int r = 0; r < R; r++) {
            const int8_t *p = q->w + (r0 + r) * q->n + e;
            if (pf) prefetch_weight((const char *)p + pf, q->pf_where);
            __m512i v = _mm512_maskz_loadu_epi8(m, p);
            /* Low nibbles: (v >> 8k) & 0x0f | 0x4300 (truth table 0xea: A & B | C); high nibbles:
             * (v >> 4 + 8k) & 0x0f ^ 0x4508 (0x6a: A & B ^ C), the xor flipping the sign bit. */
            nib[r][0] = (__m512bh)_mm512_ternarylogic_epi32(v, low, exp128, 0xea);
            nib[r][1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, exp2048_flip, 0x6a);
            nib[r][2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low, exp128, 0xea);
            nib[r][3] = (__m512bh)_mm512_xor_si512(_mm512_srli_epi16(v, 12), exp2048_flip);
        }
        UNROLL for (int c = 0; c < C; c++) {
            const uint16_t *xc = x + c * q->xstride + xo;
            __m512bh xe = (__m512bh)_mm512_loadu_si512(xc), xd = (__m512bh)_mm512_loadu_si512(xc + 32);
            __m512 init = _mm512_loadu_ps((const float *)(xc + 64)), t[TILE_R];
            UNROLL for (int r = 0; r < R; r++) {
                t[r] = _mm512_dpbf16_ps(init, nib[r][0], xe);
                t[r] = _mm512_dpbf16_ps(t[r], nib[r][1], xe);
                t[r] = _mm512_dpbf16_ps(t[r], nib[r][2], xd);
                t[r] = _mm512_dpbf16_ps(t[r], nib[r][3], xd);
            }
            UNROLL for (int r = 0; r < R; r++) acc[r][c] = _mm512_add_ps(acc[r][c], t[r]);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Without BF16 dot products: sixteen weights at a time sign-extended to 32 bits and converted to
 * fp32 (exact), each an FMA against x, widened to fp32 once per call. Three instructions per
 * sixteen weights and x row, against the AVX2 path's three per eight. Four weight rows against
 * four x rows: sixteen accumulators, each x load folded into its FMA; a one-row tile's four
 * chains of FMAs are shorter than the tile's step, so their latency does not bound it. On the
 * Intel CPUs this path is for, a non-temporal prefetch streamed two thirds as fast as one into
 * every cache level (docs/quantization.md): c-ahead, measured beside c-prefetch. */
#define TILE_R 4
#define TILE_C 4
#define X_ELEM float
const char *q8_isa(void) { return "avx512f"; }

/* x in fp32, zero past n up to a whole vector: a row's last, partial vector loads zeros there. */
static int64_t x_stride(int64_t n) { return (n + 15) & ~(int64_t)15; }
static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i));
        _mm512_storeu_si512(xw + i, _mm512_slli_epi32(v, 16));
    }
}

static inline __attribute__((always_inline)) void tile(const struct q8 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const float *x = (const float *)q->x + c0 * q->xstride;
    __m512 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t pf = (r0 + R) * q->n + q->pf_bytes <= q->rows * q->n ? q->pf_bytes : 0;
    int64_t e = 0;
    for (; e + 16 <= q->n; e += 16) {
        UNROLL for (int r = 0; r < R; r++) {
            const int8_t *p = q->w + (r0 + r) * q->n + e;
            if (pf && (e & 63) == 0) prefetch_weight((const char *)p + pf, q->pf_where);
            __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(f, _mm512_loadu_ps(x + c * q->xstride + e), acc[r][c]);
        }
    }
    if (e < q->n) {
        /* The row's last, partial vector: zeros past its end meet x's zeros. */
        __mmask16 m = (__mmask16)((1u << (q->n - e)) - 1u);
        UNROLL for (int r = 0; r < R; r++) {
            __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q->w + (r0 + r) * q->n + e)));
            UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(f, _mm512_loadu_ps(x + c * q->xstride + e), acc[r][c]);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* Eight weights at a time sign-extended and converted to fp32, x widened to fp32 once per call.
 * Two weight rows against four x rows: eight accumulators. One x row goes against four weight rows:
 * each sum is one chain of FMAs, which alone waits on their latency (8 bytes of weight per FMA),
 * below a memory's rate on two cores; four chains hide it. Each (weight row, x row) is summed by
 * the same operations in either shape. */
#define TILE_R 4
#define TILE_C 4
#define FEW_TILE_R 2
#define X_ELEM float
const char *q8_isa(void) { return "avx2"; }
static int64_t x_stride(int64_t n) { return n; }

static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < n; i++) xw[i] = bf16_to_f32(x[i]);
}

static inline __attribute__((always_inline)) void tile(const struct q8 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const float *x = (const float *)q->x + c0 * q->xstride;
    __m256 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t pf = (r0 + R) * q->n + q->pf_bytes <= q->rows * q->n ? q->pf_bytes : 0;
    int64_t e = 0;
    for (; e + 8 <= q->n; e += 8) {
        __m256 f[TILE_R];
        UNROLL for (int r = 0; r < R; r++) {
            const int8_t *p = q->w + (r0 + r) * q->n + e;
            if (pf && (e & 63) == 0) prefetch_weight((const char *)p + pf, q->pf_where);
            f[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        }
        UNROLL for (int c = 0; c < C; c++) {
            __m256 xv = _mm256_loadu_ps(x + c * q->xstride + e);
            UNROLL for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(f[r], xv, acc[r][c]);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) {
            float t = hsum8(acc[r][c]);
            for (int64_t k = e; k < q->n; k++) t += (float)q->w[(r0 + r) * q->n + k] * x[c * q->xstride + k];
            o[r][c] = t;
        }
}

#else
#define TILE_R 1
#define TILE_C 4
#define X_ELEM float
const char *q8_isa(void) { return "scalar"; }
static int64_t x_stride(int64_t n) { return n; }

static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < n; i++) xw[i] = bf16_to_f32(x[i]);
}

static inline void tile(const struct q8 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    (void)R;
    const float *x = (const float *)q->x + c0 * q->xstride;
    const int8_t *w = q->w + r0 * q->n;
    UNROLL for (int c = 0; c < C; c++) {
        float t = 0.f;
        for (int64_t k = 0; k < q->n; k++) t += (float)w[k] * x[c * q->xstride + k];
        o[0][c] = t;
    }
}
#endif

#ifndef FEW_TILE_R
#define FEW_TILE_R TILE_R
#endif

#define TILE_Q struct q8
#include "run_tile.h"
#undef TILE_Q

/* Tile (r0, c0) of q8_gemm's call: its outputs times their rows' scales. */
struct q8_call {
    struct q8 q;
    const struct q8_weight *wt;
    uint16_t *y;
};
static void q8_tile(const void *ctx, int64_t r0, int R, int64_t c0, int C) {
    const struct q8_call *k = ctx;
    const struct q8_weight *wt = k->wt;
    float o[TILE_R][TILE_C];
    /* The scales read after the tile: their line is asked for first. */
    if (c0 == 0) prefetch_line((const char *)wt->s + r0 * (wt->kind == SCALE_F32 ? 4 : 2));
    run_tile(&k->q, r0, c0, R, C, o);
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) k->y[(c0 + c) * wt->rows + r0 + r] = f32_to_bf16(o[r][c] * scale_at(wt->s, wt->kind, r0 + r));
}

/* y [m, rows] = x [m, n] W^T, row r scaled by s[r]. prefetch and where as for q4_gemm (at
 * least that many bytes ahead, in whole tiles). Returns 0, or -1 when the scratch for x could not
 * be allocated (nothing written). */
int q8_gemm(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    const int64_t rows = wt->rows, n = wt->n;
    const int64_t xs = x_stride(n);
    X_ELEM *xw = scratch((size_t)(m * xs) * sizeof(X_ELEM));
    if (xw == NULL) return -1;
    for (int64_t c = 0; c < m; c++) prepare_x(x + c * n, n, xw + c * xs);
    const int64_t tr = m == 1 ? TILE_R : FEW_TILE_R, tile_bytes = tr * n;
    struct q8_call k = {{wt->w, rows, n, whole_tiles(prefetch, tile_bytes), where, xw, xs}, wt, y};
    run_tiles(&k, q8_tile, rows, m, tr, TILE_C, wt->w, tile_bytes, k.q.pf_bytes);
    return 0;
}
