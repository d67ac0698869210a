/* Y = X W^T for symmetric int4 weights (zero 8, the layout of gemv_int4.c) and a few bf16 rows X,
 * with each x row first quantized to int8: blocks of 32 inputs, scale = the block's largest |x|
 * / 127, each input rint(x * 127 / largest). The products are then integer dot products of bytes
 * (AVX-512 VNNI: 64 weight-by-input products per instruction; AVX2: vpmaddubsw then vpmaddwd),
 * where the bf16 tile of gemv_int4.c spends seven instructions per 128 weights making them bf16
 * and the AVX2 one widens every weight to fp32. Those tiles run out of instructions before a fast
 * memory runs out of bytes; these do not. The price is x's rounding to 8 bits: the reference is
 * layout.quant_linear_int8x_reference, which rounds x the same way.
 *
 * Layout per x row, for every 128 inputs (one 64-byte load of weights, or two 32-byte ones: byte j
 * holds input 2j in its low nibble and 2j + 1 in its high one): 32-bit lane l of the low nibbles
 * holds inputs 8l, 8l+2, 8l+4, 8l+6 and of the high nibbles 8l+1, 8l+3, 8l+5, 8l+7, so x is kept
 * as those two byte runs (64 bytes each), then 16 lane starts (int32) and 16 lane scales (fp32);
 * lane l's eight inputs lie in one block of 32. Each lane starts from -8 times its inputs' sum (the
 * zero point), so it ends with the sum of (q - 8) xq as an exact int32; that, times its block's
 * scale and its group's weight scale, goes into the row's fp32 sum. Every (weight row, x row) pair
 * is summed by the same operations whatever the tile around it, so a row of a few-row call equals
 * the one-row call bit for bit.
 *
 * Built where the compiler targets AVX-512 VNNI (with BW and VL) or AVX2; elsewhere q4x_isa says
 * why not and q4x_gemm returns -2.
 */
#include <stdint.h>

#include "quant.h"

#if defined(INT8X_AVX512) || defined(INT8X_AVX2)
#include <immintrin.h>

/* One x row's int8 form, per 128 inputs: 64 bytes of even inputs, 64 of odd ones, 16 lane starts
 * (int32) and 16 lane scales (fp32); n padded to 128 with zeros. */
static inline int64_t xq_bytes(int64_t n) { return ((n + 127) / 128) * 256; }

struct q4v {
    const uint8_t *w;
    const void *s;
    int64_t kind, rows, n, group, ng;
    int64_t pf_bytes, pf_where; /* as gemv_int4.c's */
    const int8_t *xq;         /* the x rows' int8 form (quantize_x), xq_bytes(n) apart */
};

#ifdef INT8X_AVX512
#define TILE_R 4
#define TILE_C 4
const char *q4x_isa(void) { return "avx512_vnni"; }

static void quantize_x(const uint16_t *x, int64_t n, int8_t *out) {
    /* Sixteen inputs, eight per lane: the even ones of both lanes, then the odd ones. */
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t st = 0; st < (n + 127) / 128; st++) {
        int8_t *xe = out + st * 256, *xo = xe + 64;
        float scale[16];
        for (int b = 0; b < 4; b++) {
            const int64_t i0 = st * 128 + b * 32, left = n - i0;
            const __mmask32 m = left >= 32 ? (__mmask32)~0u : left <= 0 ? 0 : (__mmask32)((1u << left) - 1u);
            __m512 v[2];
            for (int h = 0; h < 2; h++) {
                __m256i raw = _mm256_maskz_loadu_epi16((__mmask16)(m >> (16 * h)), x + i0 + 16 * h);
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            }
            const float big = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const __m512 inv = _mm512_set1_ps(big > 0.f ? 127.f / big : 0.f);
            /* rint (to nearest even, the default rounding) of x * 127 / big: within -127..127. */
            __m128i s0 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv))), split);
            __m128i s1 = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv))), split);
            _mm_storeu_si128((__m128i *)(xe + 16 * b), _mm_unpacklo_epi64(s0, s1));
            _mm_storeu_si128((__m128i *)(xo + 16 * b), _mm_unpackhi_epi64(s0, s1));
            for (int l = 0; l < 4; l++) scale[4 * b + l] = big / 127.f;
        }
        /* Each lane's start, -8 times its eight inputs' sum, by the same dot product against ones. */
        const __m512i ones = _mm512_set1_epi8(1);
        __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xe));
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(xo));
        _mm512_storeu_si512(xe + 128, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-8)));
        _mm512_storeu_ps(xe + 192, _mm512_loadu_ps(scale));
    }
}

static inline __attribute__((always_inline)) void tile(const struct q4v *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const __m512i low = _mm512_set1_epi8(0x0f), lane_group = lane_groups(q->group);
    const int64_t nb = q->n / 2, xbytes = xq_bytes(q->n), sbytes = q->kind == SCALE_F32 ? 4 : 2;
    const int8_t *xq = q->xq + c0 * xbytes;
    __m512 acc[TILE_R][TILE_C], sv[TILE_R];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    /* As gemv_int4.c's tiles: the rows' scales sixteen groups at a time, the next tile's scales
     * prefetched a line per step, the weight pf_bytes (whole tiles) ahead. */
    int64_t g0 = -16, gi = 16, ge = 0;
    const char *snext = (const char *)q->s + (r0 + R) * q->ng * sbytes;
    const int64_t sleft = r0 + R < q->rows ? min64(TILE_R, q->rows - r0 - R) * q->ng * sbytes : 0;
    const int64_t pf = (r0 + R) * nb + q->pf_bytes <= q->rows * nb ? q->pf_bytes : 0;
    for (int64_t e = 0; e < q->n; e += 128) {
        if (e / 2 < sleft) _mm_prefetch(snext + e / 2, _MM_HINT_T0);
        if (gi == 16) {
            g0 += 16, gi = 0;
            UNROLL for (int r = 0; r < R; r++) sv[r] = scales16(q->s, q->kind, (r0 + r) * q->ng + g0, min64(16, q->ng - g0));
        }
        const __mmask64 m = q->n - e >= 128 ? ~(__mmask64)0 : (((__mmask64)1 << ((q->n - e) / 2)) - 1);
        const __m512i gidx = _mm512_add_epi32(lane_group, _mm512_set1_epi32((int)gi));
        __m512i lo[TILE_R], hi[TILE_R];
        __m512 sw[TILE_R];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = q->w + (r0 + r) * nb + e / 2;
            if (pf) prefetch_weight((const char *)p + pf, q->pf_where);
            __m512i v = _mm512_maskz_loadu_epi8(m, p);
            lo[r] = _mm512_and_si512(v, low);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            sw[r] = _mm512_permutexvar_ps(gidx, sv[r]);
        }
        UNROLL for (int c = 0; c < C; c++) {
            const int8_t *xs = xq + c * xbytes + e * 2;
            const __m512i xe = _mm512_loadu_si512(xs), xo = _mm512_loadu_si512(xs + 64), start = _mm512_loadu_si512(xs + 128);
            const __m512 sx = _mm512_loadu_ps(xs + 192);
            UNROLL for (int r = 0; r < R; r++) {
                __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo[r], xe), hi[r], xo);
                acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), sx), sw[r], acc[r][c]);
            }
        }
        for (ge += 128; ge >= q->group; ge -= q->group) gi++;
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#else
/* AVX2: vpmaddubsw sums two byte products into 16 bits (at most 2 * 15 * 127, no saturation),
 * vpmaddwd pairs of 16-bit lanes into a 32-bit lane: the products a VNNI lane sums. 32 bytes of
 * weights at a time, eight lanes: each 128 inputs are two halves. */
#define TILE_R 4
#define TILE_C 2
const char *q4x_isa(void) { return "avx2"; }

/* The layout above in plain C, each block rounded by quant.h's round_x_block (as the AVX-512 form
 * rounds). */
static void quantize_x(const uint16_t *x, int64_t n, int8_t *out) {
    for (int64_t st = 0; st < (n + 127) / 128; st++) {
        int8_t *xe = out + st * 256, *xo = xe + 64;
        int32_t *start = (int32_t *)(xe + 128);
        float *scale = (float *)(xe + 192);
        for (int b = 0; b < 4; b++) {
            int8_t q[32];
            const float d = round_x_block(x, n, st * 4 + b, q);
            for (int l = 0; l < 4; l++) {
                int32_t sum = 0;
                for (int j = 0; j < 4; j++) {
                    const int8_t e = q[8 * l + 2 * j], o = q[8 * l + 2 * j + 1];
                    xe[16 * b + 4 * l + j] = e, xo[16 * b + 4 * l + j] = o;
                    sum += e + o;
                }
                start[4 * b + l] = -8 * sum;
                scale[4 * b + l] = d;
            }
        }
    }
}

/* A run of a row's weight scales as fp32, whatever their stored kind (exact conversions). */
static inline void scales_f32(const void *s, int64_t kind, int64_t i, int64_t count, float *out) {
    int64_t j = 0;
    if (kind == SCALE_BF16) {
        const uint16_t *b = (const uint16_t *)s + i;
        for (; j + 8 <= count; j += 8)
            _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + j))), 16)));
    }
    for (; j < count; j++) out[j] = scale_at(s, kind, i + j);
}

/* Inputs a step of the tile below converts its rows' scales for at a time. */
#define SCALE_RUN 1024

/* The C x rows' parts for half h of step e (xe, xo, st, sx), declared and held in registers for
 * the tile's rows (the empty asm: left to the compiler they were read again by every row's
 * instructions, four more loads a row). */
#define X_HALF(e, h) \
    __m256i xe[TILE_C], xo[TILE_C], st[TILE_C]; \
    __m256 sx[TILE_C]; \
    UNROLL for (int c = 0; c < C; c++) { \
        const int8_t *xs_ = xq + c * xbytes + (e) * 2; \
        xe[c] = _mm256_loadu_si256((const __m256i *)(xs_ + 32 * (h))); \
        xo[c] = _mm256_loadu_si256((const __m256i *)(xs_ + 64 + 32 * (h))); \
        st[c] = _mm256_loadu_si256((const __m256i *)(xs_ + 128 + 32 * (h))); \
        sx[c] = _mm256_loadu_ps((const float *)(xs_ + 192) + 8 * (h)); \
        __asm__("" : "+x"(xe[c]), "+x"(xo[c]), "+x"(st[c]), "+x"(sx[c])); \
    }
/* One row's half-step (64 inputs, 32 weight bytes v) against C x rows: xe, xo, st, sx the x
 * rows' parts for this half; each lane's exact int32 sum, scaled by its x block and sw. Every
 * tile form runs it, so a (weight row, x row) pair is summed alike in all of them. */
#define HALF_ROW(v, acc_r, sw) do { \
        const __m256i lo_ = _mm256_and_si256(v, low), hi_ = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); \
        UNROLL for (int c = 0; c < C; c++) { \
            __m256i t_ = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo_, xe[c]), _mm256_maddubs_epi16(hi_, xo[c])), ones); \
            t_ = _mm256_add_epi32(t_, st[c]); \
            acc_r[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t_), sx[c]), sw, acc_r[c]); \
        } \
    } while (0)

/* A half's weight scales per lane from a row's fp32 run at p: lanes 0-3 from p[0], lanes 4-7 from
 * p[1] with `pick` (0,0,0,0,1,1,1,1: groups of 32), else all from p[0] (pick zero). */
static inline __m256 half_scales(const float *p, __m256i pick) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)p))), pick);
}

/* The tile's whole steps e0..ew (128 inputs each, both halves' 32 weight bytes present), the
 * rows' scales for the run from e0 in sc. Groups of 32 give a half two scales (lanes 0-3 and 4-7),
 * larger groups one, broadcast: `g32` a constant, so each form is its own loop. */
static inline __attribute__((always_inline)) void whole_steps(const struct q4v *q, const int8_t *xq, int64_t xbytes, const uint8_t *const *wr,
                                                              float sc[TILE_R][SCALE_RUN / 32 + 2], int64_t e0, int64_t ew, int lg, int64_t pf,
                                                              int R, int C, __m256 acc[TILE_R][TILE_C], int g32) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int64_t e = e0; e < ew; e += 128) {
        if (pf) UNROLL for (int r = 0; r < R; r++) prefetch_weight((const char *)(wr[r] + e / 2) + pf, q->pf_where);
        UNROLL for (int h = 0; h < 2; h++) {
            X_HALF(e, h);
            const int64_t si = (e - e0 + 64 * h) >> lg;
            UNROLL for (int r = 0; r < R; r++) {
                const __m256 sw = g32 ? half_scales(sc[r] + si, pick) : _mm256_broadcast_ss(sc[r] + si);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + e / 2 + 32 * h));
                HALF_ROW(v, acc[r], sw);
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile(const struct q4v *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int64_t nb = q->n / 2, xbytes = xq_bytes(q->n), group = q->group;
    const int8_t *xq = q->xq + c0 * xbytes;
    __m256 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t pf = (r0 + R) * nb + q->pf_bytes <= q->rows * nb ? q->pf_bytes : 0;
    const __m256i pick = group == 32 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setzero_si256();
    const int lg = group == 32 ? 5 : group == 64 ? 6 : 7;
    const uint8_t *wr[TILE_R];
    UNROLL for (int r = 0; r < R; r++) wr[r] = q->w + (r0 + r) * nb;
    /* The rows' scales as fp32 a run of SCALE_RUN inputs at a time (one more, zero: a last half's
     * second group of 32 past the row's end), read by the steps without a branch on their kind. */
    float sc[TILE_R][SCALE_RUN / 32 + 2];
    const int64_t whole = q->n / 128 * 128;
    for (int64_t e0 = 0; e0 < q->n; e0 += SCALE_RUN) {
        const int64_t e1 = min64(e0 + SCALE_RUN, q->n), g0 = e0 >> lg, count = ((e1 - e0) + group - 1) >> lg;
        UNROLL for (int r = 0; r < R; r++) {
            scales_f32(q->s, q->kind, (r0 + r) * q->ng + g0, count, sc[r]);
            sc[r][count] = 0.f;
        }
        const int64_t ew = min64(e1, whole);
        if (group == 32)
            whole_steps(q, xq, xbytes, wr, sc, e0, ew, lg, pf, R, C, acc, 1);
        else
            whole_steps(q, xq, xbytes, wr, sc, e0, ew, lg, pf, R, C, acc, 0);
        /* The row's last, part step (n not a multiple of 128): zeros past its end meet x's padding. */
        for (int64_t e = ew; e < e1; e += 128) {
            for (int h = 0; h < 2; h++) {
                const int64_t i0 = e + 64 * h, left = (q->n - i0) / 2;
                if (left <= 0) break;
                X_HALF(e, h);
                const int64_t si = (i0 - e0) >> lg;
                UNROLL for (int r = 0; r < R; r++) {
                    const __m256 sw = half_scales(sc[r] + si, pick);
                    uint8_t tail[32] = {0};
                    memcpy(tail, wr[r] + i0 / 2, (size_t)min64(left, 32));
                    const __m256i v = _mm256_loadu_si256((const __m256i *)tail);
                    HALF_ROW(v, acc[r], sw);
                }
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = hsum8(acc[r][c]);
}
#undef HALF_ROW
#undef X_HALF
#endif

#define TILE_Q struct q4v
#include "run_tile.h"
#undef TILE_Q

/* Tile (r0, c0) of q4x_gemm's call: its outputs. */
struct q4x_call {
    struct q4v q;
    uint16_t *y;
};
static void q4x_tile(const void *ctx, int64_t r0, int R, int64_t c0, int C) {
    const struct q4x_call *k = ctx;
    float o[TILE_R][TILE_C];
    run_tile(&k->q, r0, c0, R, C, o);
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) k->y[(c0 + c) * k->q.rows + r0 + r] = f32_to_bf16(o[r][c]);
}

/* y [m, rows] = x [m, n] W^T, as q4_gemm in gemv_int4.c (prefetch, where the same). Returns 0;
 * -1 when x's scratch could not be allocated; -2 for weights with zero points (nothing written). */
int q4x_gemm(const struct q4_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    if (wt->z != NULL) return -2;
    const int64_t rows = wt->rows, n = wt->n, xbytes = xq_bytes(n);
    int8_t *xq = scratch((size_t)(m * xbytes));
    if (xq == NULL) return -1;
    for (int64_t c = 0; c < m; c++) quantize_x(x + c * n, n, xq + c * xbytes);
    const int64_t tile_bytes = TILE_R * (n / 2);
    struct q4x_call k = {{wt->w, wt->s, wt->kind, rows, n, wt->group, n / wt->group, whole_tiles(prefetch, tile_bytes), where, xq}, y};
    run_tiles(&k, q4x_tile, rows, m, TILE_R, TILE_C, wt->w, tile_bytes, k.q.pf_bytes);
    return 0;
}

#else
const char *q4x_isa(void) { return "unavailable: the CPU (or the compiler) has neither AVX-512 VNNI nor AVX2"; }
int q4x_gemm(const struct q4_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)wt, (void)x, (void)y, (void)m, (void)prefetch, (void)where;
    return -2;
}
#endif
