/* Y = X W^T for int4 weights (symmetric or with zero points, the layout of gemv_int4.c) or int8
 * weights (gemv_int8.c's) and many bf16 rows X (a prefill), each x row first rounded to int8 as the
 * int8-x GEMVs round it (quant.h round_x_block: blocks of 32 inputs, scale = the block's largest
 * |x| / 127). The reference is layout.quant_linear_int8x_reference.
 *
 * The GEMVs' tiles keep a weight row's inputs along a vector's lanes and sum the lanes at the end;
 * with many x rows that costs a conversion, a multiply and an FMA per (weight row, x row, block of
 * inputs), and the tiles ran a prefill no faster than dequantized blocks through an fp32 GEMM.
 * Here a vector's 32-bit lanes are weight rows instead (eight with AVX2, sixteen with AVX-512
 * VNNI): each group of LANES rows is first laid out (into a per-thread buffer, once per call) as a
 * block's eight vectors of four inputs per row. Against one x row, a block is then eight byte dot
 * products of a weight vector by x's four inputs broadcast and one conversion and FMA for all the
 * group's rows: the scale work is shared by LANES rows, and each weight vector, loaded once,
 * serves MR x rows. int4 keeps each nibble in a
 * byte of its own and sums a block's products in 16 bits (at most 8 * 2 * 15 * 127: no
 * saturation), then one vpmaddwd; int8 moves each weight's sign onto x (vpsignb) and widens every
 * vpmaddubsw (two do not fit 16 bits).
 *
 * Per (x row, weight row) a block's 32 products are an exact integer sum; int4's d - zero * (sum
 * of the block's x), exact in fp32, times (the group's weight scale times the block's x scale), or
 * int8's d times the block's x scale, goes into the row's fp32 sum in block order (int8: times
 * the row's scale at the end). Every pair is summed so whatever the tile or call around it: a
 * row's outputs do not depend on the other rows of the pass.
 *
 * Built where the compiler targets AVX2 with FMA (VNNI where it has it, 512-bit with AVX-512
 * VNNI); elsewhere int8x_many_isa says why not and both entry points return -2.
 */
#include <stdint.h>

#include "quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 4 /* x rows a tile takes (run_tile's cases): their integer and fp32 sums stay in registers */
#define GROUPS 2 /* groups of LANES weight rows laid out at a time, each x tile then runs against all */

/* The vector a tile works in: sixteen 32-bit lanes (weight rows) with AVX-512 VNNI, else eight.
 * Byte dot products into 32-bit lanes where the CPU has them (AVX-512 VNNI, or AVX-VNNI): one
 * vpdpbusd for a vpmaddubsw, its 16-bit sum and the vpmaddwd after; the same exact sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define LANES 16
typedef __m512i vec_i;
typedef __m512 vec_f;
#define V_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define V_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define V_BCAST(d) _mm512_set1_epi32(d)
#define V_ZERO_I() _mm512_setzero_si512()
#define V_ZERO() _mm512_setzero_ps()
#define V_LOADF(p) _mm512_loadu_ps(p)
#define V_STOREF(p, v) _mm512_storeu_ps(p, v)
#define V_SET1F(f) _mm512_set1_ps(f)
#define V_CVT(v) _mm512_cvtepi32_ps(v)
#define V_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_FNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ABS8(w) _mm512_abs_epi8(w)
/* x with each byte negated where the weight's byte is negative (vpsignb has no 512-bit form; where
 * the weight is zero its magnitude zeroes the product anyway). */
#define V_SIGN8(x, w) _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x)
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
const char *int8x_many_isa(void) { return "avx512_vnni"; }
#else
#define LANES 8
typedef __m256i vec_i;
typedef __m256 vec_f;
#define V_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define V_BCAST(d) _mm256_set1_epi32(d)
#define V_ZERO_I() _mm256_setzero_si256()
#define V_ZERO() _mm256_setzero_ps()
#define V_LOADF(p) _mm256_loadu_ps(p)
#define V_STOREF(p, v) _mm256_storeu_ps(p, v)
#define V_SET1F(f) _mm256_set1_ps(f)
#define V_CVT(v) _mm256_cvtepi32_ps(v)
#define V_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_FNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ABS8(w) _mm256_abs_epi8(w)
#define V_SIGN8(x, w) _mm256_sign_epi8(x, w)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
const char *int8x_many_isa(void) { return "avx512_vnni (256-bit)"; }
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
const char *int8x_many_isa(void) { return "avx_vnni"; }
#else
const char *int8x_many_isa(void) { return "avx2"; }
#endif
#endif
/* A block's bytes for one group of LANES weight rows: eight vectors of LANES dwords. */
#define BLOCK_BYTES (32 * LANES)

/* One x row's form: per block of 32 inputs, its 16 even inputs then its 16 odd ones (the order a
 * weight vector's low and high nibbles hold them), then every block's scale, then every block's sum
 * of its int8 inputs (fp32, exact). */
static inline int64_t blocks(int64_t n) { return (n + 31) / 32; }
static inline int64_t x_bytes(int64_t n) { return (blocks(n) * 40 + 63) / 64 * 64; }

static void quantize_x(const uint16_t *x, int64_t n, int8_t *out) {
    const int64_t nb = blocks(n);
    float *dx = (float *)(out + nb * 32), *sx = dx + nb;
    for (int64_t b = 0; b < nb; b++) {
        int8_t q[32];
        dx[b] = round_x_block(x, n, b, q);
        int32_t s = 0;
        for (int i = 0; i < 16; i++) {
            out[32 * b + i] = q[2 * i], out[32 * b + 16 + i] = q[2 * i + 1];
            s += q[2 * i] + q[2 * i + 1];
        }
        sx[b] = (float)s;
    }
}

/* LANES int4 weight rows from r0 (rows past the weight's end as zeros) laid out for tile_q4: per
 * block, eight vectors of LANES dwords, vector t lane r holding row r's four inputs of x's dword t
 * (the low nibbles of the row's bytes 4t..4t+3 for t < 4, the high nibbles of bytes 4(t-4).. after),
 * each nibble a byte; then per group the rows' scales and zero points as fp32. Built eight rows
 * (32 bytes of each vector) at a time. */
static inline int64_t group_bytes_q4(int64_t n, int64_t ng) { return (n / 32) * BLOCK_BYTES + ng * 8 * LANES; }

static void lay_out_q4(const struct q4_weight *wt, int64_t r0, uint8_t *out) {
    const int64_t nbytes = wt->n / 2, nb = wt->n / 32, ng = wt->n / wt->group;
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < LANES / 8; h++) {
        const int valid = (int)min64(8, wt->rows - r0 - 8 * h);
        for (int64_t b = 0; b < nb; b++) {
            __m128i v[8];
            for (int r = 0; r < 8; r++) v[r] = r < valid ? _mm_loadu_si128((const __m128i *)(wt->w + (r0 + 8 * h + r) * nbytes + 16 * b)) : _mm_setzero_si128();
            /* Rows r and r + 4 in one vector's halves, then a 4 x 4 transpose of dwords in each
             * half: P[d] lane r = row r's bytes 4d..4d+3. */
            __m256i a[4], t[4], p[4];
            for (int k = 0; k < 4; k++) a[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(v[k]), v[k + 4], 1);
            t[0] = _mm256_unpacklo_epi32(a[0], a[1]), t[1] = _mm256_unpackhi_epi32(a[0], a[1]);
            t[2] = _mm256_unpacklo_epi32(a[2], a[3]), t[3] = _mm256_unpackhi_epi32(a[2], a[3]);
            p[0] = _mm256_unpacklo_epi64(t[0], t[2]), p[1] = _mm256_unpackhi_epi64(t[0], t[2]);
            p[2] = _mm256_unpacklo_epi64(t[1], t[3]), p[3] = _mm256_unpackhi_epi64(t[1], t[3]);
            uint8_t *o = out + b * BLOCK_BYTES + 32 * h;
            for (int d = 0; d < 4; d++) {
                _mm256_storeu_si256((__m256i *)(o + 4 * LANES * d), _mm256_and_si256(p[d], low));
                _mm256_storeu_si256((__m256i *)(o + 4 * LANES * (d + 4)), _mm256_and_si256(_mm256_srli_epi16(p[d], 4), low));
            }
        }
    }
    float *sw = (float *)(out + nb * BLOCK_BYTES), *zf = sw + ng * LANES;
    const int valid = (int)min64(LANES, wt->rows - r0);
    for (int64_t g = 0; g < ng; g++)
        for (int r = 0; r < LANES; r++) {
            const int64_t i = (r0 + r) * ng + g;
            sw[LANES * g + r] = r < valid ? scale_at(wt->s, wt->kind, i) : 0.f;
            zf[LANES * g + r] = r >= valid ? 0.f : wt->z != NULL ? (float)wt->z[i] : 8.f;
        }
}

static inline int32_t dword_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* x rows c0..c0+C (their forms xbytes apart from xq) against one laid-out group of LANES weight
 * rows: acc[c] lane r is x row c's product with weight row r. */
static inline __attribute__((always_inline)) void tile_q4(const uint8_t *wp, int64_t n, int64_t group, const int8_t *xq, int64_t xbytes, int C, vec_f acc[MR]) {
    const int64_t nb = n / 32, ng = n / group, per_group = group / 32;
    const float *sw = (const float *)(wp + nb * BLOCK_BYTES), *zf = sw + ng * LANES;
#ifndef DPBUSD
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    UNROLL for (int c = 0; c < C; c++) acc[c] = V_ZERO();
    int64_t g = 0, in_group = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wp + b * BLOCK_BYTES;
        vec_i sums[MR]; /* 32-bit sums with vpdpbusd, 16-bit ones without */
        UNROLL for (int c = 0; c < C; c++) sums[c] = V_ZERO_I();
        UNROLL for (int t = 0; t < 8; t++) {
            const vec_i wv = V_LOAD(w + 4 * LANES * t);
            UNROLL for (int c = 0; c < C; c++) {
                const vec_i xv = V_BCAST(dword_at(xq + c * xbytes + 32 * b + 4 * t));
#ifdef DPBUSD
                sums[c] = DPBUSD(sums[c], wv, xv);
#else
                sums[c] = _mm256_add_epi16(sums[c], _mm256_maddubs_epi16(wv, xv));
#endif
            }
        }
        const vec_f s = V_LOADF(sw + LANES * g), z = V_LOADF(zf + LANES * g);
        UNROLL for (int c = 0; c < C; c++) {
            const float *dx = (const float *)(xq + c * xbytes + nb * 32);
#ifdef DPBUSD
            vec_f f = V_CVT(sums[c]);
#else
            vec_f f = V_CVT(_mm256_madd_epi16(sums[c], ones));
#endif
            f = V_FNMADD(z, V_SET1F(dx[nb + b]), f);
            acc[c] = V_FMADD(f, V_MUL(s, V_SET1F(dx[b])), acc[c]);
        }
        if (++in_group == per_group) in_group = 0, g++;
    }
}

/* LANES int8 weight rows from r0 (rows past the end as zeros) laid out for tile_q8: per block,
 * eight vectors of LANES dwords of signed bytes, vector t lane r holding row r's four inputs of
 * x's dword t; then the rows' scales as fp32. Built eight rows at a time. */
static inline int64_t group_bytes_q8(int64_t n) { return blocks(n) * BLOCK_BYTES + 64; /* the scales, a line */ }

static void lay_out_q8(const struct q8_weight *wt, int64_t r0, uint8_t *out) {
    const int64_t nb = blocks(wt->n);
    /* In each 16-byte half: its even bytes, then its odd ones; the row's dwords are then x's
     * dwords 0, 1, 4, 5, 2, 3, 6, 7. */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    static const int slot[8] = {0, 1, 4, 5, 2, 3, 6, 7};
    for (int h = 0; h < LANES / 8; h++) {
        const int valid = (int)min64(8, wt->rows - r0 - 8 * h);
        for (int64_t b = 0; b < nb; b++) {
            __m256i v[8], t[8], u[8];
            const int64_t left = wt->n - 32 * b;
            for (int r = 0; r < 8; r++) {
                const int8_t *p = wt->w + (r0 + 8 * h + r) * wt->n + 32 * b;
                if (r >= valid) {
                    v[r] = _mm256_setzero_si256();
                } else if (left >= 32) {
                    v[r] = _mm256_loadu_si256((const __m256i *)p);
                } else { /* a row's last inputs: zeros past its end meet x's zero padding */
                    int8_t tail[32] = {0};
                    memcpy(tail, p, (size_t)left);
                    v[r] = _mm256_loadu_si256((const __m256i *)tail);
                }
                v[r] = _mm256_shuffle_epi8(v[r], split);
            }
            /* An 8 x 8 transpose of dwords: vector j lane r = row r's dword j. */
            for (int k = 0; k < 8; k += 4) {
                t[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]), t[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);
                t[k + 2] = _mm256_unpacklo_epi32(v[k + 2], v[k + 3]), t[k + 3] = _mm256_unpackhi_epi32(v[k + 2], v[k + 3]);
                u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]), u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
                u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]), u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
            }
            uint8_t *o = out + b * BLOCK_BYTES + 32 * h;
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_si256((__m256i *)(o + 4 * LANES * slot[j]), _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
                _mm256_storeu_si256((__m256i *)(o + 4 * LANES * slot[j + 4]), _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
            }
        }
    }
    float *sw = (float *)(out + nb * BLOCK_BYTES);
    const int valid = (int)min64(LANES, wt->rows - r0);
    for (int r = 0; r < LANES; r++) sw[r] = r < valid ? scale_at(wt->s, wt->kind, r0 + r) : 0.f;
}

/* tile for int8 weights: each weight's sign moved onto x, the weights' magnitudes times that
 * (vpmaddubsw: a pair's sum at most 2 * 128 * 127, no saturation, but two do not fit 16 bits, so
 * each is widened by vpmaddwd; or vpdpbusd). The block's sum, converted, times the block's x scale
 * goes into the fp32 sum; the row's one weight scale multiplies it at the end. */
static inline __attribute__((always_inline)) void tile_q8(const uint8_t *wp, int64_t n, const int8_t *xq, int64_t xbytes, int C, vec_f acc[MR]) {
    const int64_t nb = blocks(n);
#ifndef DPBUSD
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    UNROLL for (int c = 0; c < C; c++) acc[c] = V_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wp + b * BLOCK_BYTES;
        vec_i s32[MR];
        UNROLL for (int c = 0; c < C; c++) s32[c] = V_ZERO_I();
        UNROLL for (int t = 0; t < 8; t++) {
            const vec_i wv = V_LOAD(w + 4 * LANES * t), aw = V_ABS8(wv);
            UNROLL for (int c = 0; c < C; c++) {
                const vec_i xv = V_SIGN8(V_BCAST(dword_at(xq + c * xbytes + 32 * b + 4 * t)), wv);
#ifdef DPBUSD
                s32[c] = DPBUSD(s32[c], aw, xv);
#else
                s32[c] = _mm256_add_epi32(s32[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
#endif
            }
        }
        UNROLL for (int c = 0; c < C; c++) {
            const float *dx = (const float *)(xq + c * xbytes + nb * 32);
            acc[c] = V_FMADD(V_CVT(s32[c]), V_SET1F(dx[b]), acc[c]);
        }
    }
    const vec_f s = V_LOADF((const float *)(wp + nb * BLOCK_BYTES));
    UNROLL for (int c = 0; c < C; c++) acc[c] = V_MUL(acc[c], s);
}

/* A laid-out group against x rows with the x row count a constant, so the sums stay in
 * registers (group 0: int8). */
static void run_tile(const uint8_t *wp, int64_t n, int64_t group, const int8_t *xq, int64_t xbytes, int C, vec_f acc[MR]) {
#define CASE(c)                                        \
    case c:                                            \
        if (group)                                     \
            tile_q4(wp, n, group, xq, xbytes, c, acc); \
        else                                           \
            tile_q8(wp, n, xq, xbytes, c, acc);        \
        break;
    switch (C) {
        CASE(4)
        CASE(3)
        CASE(2)
        default:
            CASE(1)
    }
#undef CASE
}

/* The call: the weight in either scheme (group 0: int8's q8_weight, else int4's q4_weight) and
 * its laid-out groups' size. */
struct many_call {
    const void *wt;
    int64_t rows, n, group;
    int64_t gbytes;
};

static int run_many(const struct many_call *k, const uint16_t *x, uint16_t *y, int64_t m) {
    const int64_t rows = k->rows, n = k->n, xbytes = x_bytes(n);
    int8_t *xq = scratch((size_t)(m * xbytes));
    if (xq == NULL) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < m; c++) quantize_x(x + c * n, n, xq + c * xbytes);
    const int64_t units = (rows + LANES * GROUPS - 1) / (LANES * GROUPS);
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *wp = aligned_alloc(64, (size_t)(GROUPS * k->gbytes));
        if (every_thread(wp != NULL, &failed)) {
            int64_t u0, u1;
            thread_units(units, &u0, &u1);
            for (int64_t u = u0; u < u1; u++) {
                const int64_t r0 = u * LANES * GROUPS;
                const int groups = (int)min64(GROUPS, (rows - r0 + LANES - 1) / LANES);
                for (int j = 0; j < groups; j++) {
                    if (k->group)
                        lay_out_q4(k->wt, r0 + LANES * j, wp + j * k->gbytes);
                    else
                        lay_out_q8(k->wt, r0 + LANES * j, wp + j * k->gbytes);
                }
                for (int64_t c0 = 0; c0 < m; c0 += MR) {
                    const int C = (int)min64(MR, m - c0);
                    for (int j = 0; j < groups; j++) {
                        vec_f acc[MR];
                        run_tile(wp + j * k->gbytes, n, k->group, xq + c0 * xbytes, xbytes, C, acc);
                        const int64_t rj = r0 + LANES * j, valid = min64(LANES, rows - rj);
                        for (int c = 0; c < C; c++) {
                            float o[LANES];
                            V_STOREF(o, acc[c]);
                            for (int r = 0; r < valid; r++) y[(c0 + c) * rows + rj + r] = f32_to_bf16(o[r]);
                        }
                    }
                }
            }
        }
        free(wp);
    }
    return failed ? -1 : 0;
}

/* y [m, rows] = x [m, n] W^T for int4 (q4x_many) or int8 (q8x_many) weights. prefetch and where
 * are the GEMVs' arguments, unused: the weights are read from the thread's laid-out copy. Returns
 * 0; -1 when a buffer could not be allocated (nothing written). */
int q4x_many(const struct q4_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)prefetch, (void)where;
    const struct many_call k = {wt, wt->rows, wt->n, wt->group, group_bytes_q4(wt->n, wt->n / wt->group)};
    return run_many(&k, x, y, m);
}

int q8x_many(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)prefetch, (void)where;
    const struct many_call k = {wt, wt->rows, wt->n, 0, group_bytes_q8(wt->n)};
    return run_many(&k, x, y, m);
}

#else
const char *int8x_many_isa(void) { return "unavailable: the CPU (or the compiler) has no AVX2 with FMA"; }
int q4x_many(const struct q4_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)wt, (void)x, (void)y, (void)m, (void)prefetch, (void)where;
    return -2;
}
int q8x_many(const struct q8_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    (void)wt, (void)x, (void)y, (void)m, (void)prefetch, (void)where;
    return -2;
}
#endif
