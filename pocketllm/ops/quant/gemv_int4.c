/* Y = X W^T for int4 weights and a few bf16 rows X [m, n] (m = 1: a decode step's GEMV), Y bf16
 * [m, rows]. W is the layout of pocketllm/ops/quant/layout.py: [rows, n/2] bytes, element 2j in
 * the low nibble of byte j, value (q - zero) * scale over groups of `group` inputs, scales [rows,
 * n/group] as stored (bf16, fp16 or fp32), zero 8 (symmetric, z NULL) or z [rows, n/group].
 *
 * Decode streams the weight once per step, so the loop is built to stay under memory speed:
 * weight rows go TILE_R at a time against TILE_C x rows, each nibble is unpacked once per tile,
 * each group's products are summed in fp32 and only then multiplied by its scale, and each
 * output is rounded to bf16 once. Every (weight row, x row) pair is summed by the same sequence
 * of operations whatever the tile around it, so a row of a few-row call equals the one-row call
 * bit for bit: a sequence's tokens do not depend on what it is batched with. Rows are split over
 * torch's OpenMP threads (pocketllm/compiled.py). Built with -march=native: AVX-512 BF16 dot
 * products where the CPU has them, else AVX-512 FMAs on table-dequantized weights (AVX-512
 * without its BF16 part: Skylake-X, Cascade Lake, Ice Lake), else AVX2 FMAs, else plain C.
 */
#include <stdint.h>

#include "quant.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

struct q4 {
    const uint8_t *w;
    const void *s;
    int64_t kind;
    const uint8_t *z;
    int64_t rows, n, group, ng;
    int64_t pf_bytes;  /* how far ahead of each weight load its prefetch reaches (0: none) */
    int64_t pf_where;  /* where that prefetch puts the lines (quant.h prefetch_weight) */
    const void *x;     /* the x rows as the tile reads them (prepare_x) */
    int64_t xstride;   /* elements between two of them */
    const float *xsum; /* [m, ng] each group's sum of x, where the zero term needs it */
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 128 inputs at a time, with no shuffle of the weight: 64 bytes load as 32 words, and nibble k of
 * word j is input 4j + k. Each nibble q becomes the bf16 128 + q by or-ing in the exponent of 128
 * (exact: bf16's ulp at 128 is 1), and x is laid out to match once per call (per 128 inputs, four
 * runs of 32: run k holds inputs 4j + k). A dot product lane sums eight inputs 8l..8l+7; it starts
 * from -(128 + 8) times their sum of x (also made per call), so what it holds is the sum of
 * (q - 8) x, in fp32, before its group's scale multiplies it. Asymmetric weights take the rest of
 * their zero, (z - 8) times the group's sum of x, off after (zero_term). Starting 136 |x| away
 * from the result costs some fp32 bits of each group's sum, four orders of magnitude below the
 * output's bf16 rounding. */
#define TILE_R 4
#define TILE_R_FEW 4
#define TILE_C 4
#define X_ELEM uint16_t
#define ZERO_TERM_NEEDED(z) ((z) != NULL)
const char *q4_isa(void) { return "avx512_bf16"; }

/* Per x row: the permuted bf16 inputs (rounded up to 128), then 16 fp32 starting values per 128. */
static int64_t x_stride(int64_t n) {
    int64_t npad = (n + 127) & ~(int64_t)127;
    return npad + npad / 8 * 2;
}
static void prepare_x(const uint16_t *x, int64_t n, uint16_t *xp) {
    /* Run k of a 128 takes inputs 4j + k: the first sixteen from the 128's first half, the other
     * sixteen from its second half, picked from two registers at a time. */
    const __m512i four_j = _mm512_slli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                                              13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
    __m512i pick[4];
    for (int k = 0; k < 4; k++) pick[k] = _mm512_and_si512(_mm512_add_epi16(four_j, _mm512_set1_epi16((short)k)), _mm512_set1_epi16(63));
    const int64_t npad = (n + 127) & ~(int64_t)127;
    float *init = (float *)(xp + npad);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int64_t b = 0; b < npad; b += 128) {
        __m512i in[4];
        for (int i = 0; i < 4; i++) {
            int64_t left = n - b - 32 * i;
            __mmask32 m = left >= 32 ? (__mmask32)~0u : left <= 0 ? 0 : (__mmask32)((1u << left) - 1u);
            in[i] = _mm512_maskz_loadu_epi16(m, x + b + 32 * i);
        }
        /* The lane sums of x start each dot product: computed by the same instruction, on the
         * runs just made, against ones. */
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < 4; k++) {
            __m512i lo = _mm512_permutex2var_epi16(in[0], pick[k], in[1]), hi = _mm512_permutex2var_epi16(in[2], pick[k], in[3]);
            __m512i run = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
            _mm512_storeu_si512(xp + b + 32 * k, run);
            sum = _mm512_dpbf16_ps(sum, (__m512bh)run, ones);
        }
        _mm512_storeu_ps(init + b / 8, _mm512_mul_ps(sum, _mm512_set1_ps(-136.f)));
    }
}

/* sum over groups of s_g (z_g - 8) X_g, sixteen groups at a time. */
static float zero_term(const struct q4 *q, int64_t r, int64_t c) {
    const float *xs = q->xsum + c * q->ng;
    __m512 t = _mm512_setzero_ps();
    for (int64_t g = 0; g < q->ng; g += 16) {
        int64_t count = min64(16, q->ng - g);
        __mmask16 m = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, q->z + r * q->ng + g)));
        __m512 sz = _mm512_mul_ps(scales16(q->s, q->kind, r * q->ng + g, count), _mm512_sub_ps(z, _mm512_set1_ps(8.f)));
        t = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(m, xs + g), t);
    }
    return _mm512_reduce_add_ps(t);
}

static inline __attribute__((always_inline)) void tile(const struct q4 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const __m512i low = _mm512_set1_epi16(0x0f), exp128 = _mm512_set1_epi16(0x4300);
    const __m512i lane_group = lane_groups(q->group);
    const int64_t npad = (q->n + 127) & ~(int64_t)127, nb = q->n / 2;
    const uint16_t *x = (const uint16_t *)q->x + c0 * q->xstride;
    __m512 acc[TILE_R][TILE_C], sv[TILE_R];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    /* One flat loop over 128-input steps (nested loops kept the accumulators in memory). Every
     * sixteen groups (a whole number of steps) the rows' scales are loaded as fp32; each step
     * takes its lanes' from them by index. g0: the first of the sixteen groups; gi: the step's
     * first group among them; ge: the step's inputs into its group. */
    int64_t g0 = -16, gi = 16, ge = 0;
    /* The next tile's scales (and zero points) are prefetched during this one, a line per step:
     * each row's are a few lines, too few for the hardware to see a stream, and a step that
     * waited on memory for them cost half the streaming rate. */
    const int64_t sbytes = q->kind == SCALE_F32 ? 4 : 2;
    const char *snext = (const char *)q->s + (r0 + R) * q->ng * sbytes, *znext = q->z ? (const char *)(q->z + (r0 + R) * q->ng) : NULL;
    const int64_t sleft = r0 + R < q->rows ? min64(TILE_R, q->rows - r0 - R) * q->ng * sbytes : 0;
    /* The weight prefetch: the same place in a tile pf_bytes on (rows lie one after another,
     * and the tile reads its rows side by side, so that is where it will read next); none where
     * that would pass the weight's end. */
    const int64_t pf = (r0 + R) * nb + q->pf_bytes <= q->rows * nb ? q->pf_bytes : 0;
    for (int64_t e = 0; e < q->n; e += 128) {
        if (e / 2 < sleft) {
            _mm_prefetch(snext + e / 2, _MM_HINT_T0);
            if (znext && e / 4 < sleft / sbytes) _mm_prefetch(znext + e / 4, _MM_HINT_T0);
        }
        if (gi == 16) {
            g0 += 16, gi = 0;
            UNROLL for (int r = 0; r < R; r++) sv[r] = scales16(q->s, q->kind, (r0 + r) * q->ng + g0, min64(16, q->ng - g0));
        }
        /* A row that ends inside the step loads zeros past its end, which meet x's zero padding
         * and zero starting values. */
        __mmask64 m = q->n - e >= 128 ? ~(__mmask64)0 : (((__mmask64)1 << ((q->n - e) / 2)) - 1);
        __m512i gidx = _mm512_add_epi32(lane_group, _mm512_set1_epi32((int)gi));
        __m512bh nib[TILE_R][4];
        __m512 sc[TILE_R];
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *p = q->w + (r0 + r) * nb + e / 2;
            if (pf) prefetch_weight((const char *)p + pf, q->pf_where);
            __m512i v = _mm512_maskz_loadu_epi8(m, p);
            /* (v >> 4k) & 0x0f | 0x4300: the ternary logic's truth table 0xea is A & B | C. */
            nib[r][0] = (__m512bh)_mm512_ternarylogic_epi32(v, low, exp128, 0xea);
            nib[r][1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, exp128, 0xea);
            nib[r][2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low, exp128, 0xea);
            nib[r][3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), exp128);
            sc[r] = _mm512_permutexvar_ps(gidx, sv[r]);
        }
        /* The rows' dot products interleaved step by step: each is a chain of four, and the
         * rows' chains overlap. */
        UNROLL for (int c = 0; c < C; c++) {
            const uint16_t *xc = x + c * q->xstride + e;
            __m512 init = _mm512_loadu_ps((const float *)(x + c * q->xstride + npad) + e / 8), t[TILE_R];
            UNROLL for (int r = 0; r < R; r++) t[r] = init;
            UNROLL for (int k = 0; k < 4; k++) {
                __m512bh xk = (__m512bh)_mm512_loadu_si512(xc + 32 * k);
                UNROLL for (int r = 0; r < R; r++) t[r] = _mm512_dpbf16_ps(t[r], nib[r][k], xk);
            }
            UNROLL for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(t[r], sc[r], acc[r][c]);
        }
        for (ge += 128; ge >= q->group; ge -= q->group) gi++;
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Without BF16 dot products: 32 inputs (16 bytes) at a time, loaded into each quarter of a
 * register and shifted by each lane's own count, so that every nibble comes to the bottom of one
 * lane of two vectors (widening the bytes instead took a shuffle on the port the lookups below
 * need, and was slower from cache). A nibble indexes its group's table of the sixteen values
 * (q - zero) * scale (vpermps reads an index's low four bits), so a weight becomes its fp32 value,
 * the very one layout.dequantize makes, in one instruction, with no conversion and no multiply by
 * the scale; the table is two instructions per row and group. Each value's FMA against x (widened
 * to fp32 once per call, in the same order) goes into the row's one sum. Four weight rows against
 * up to four x rows: sixteen accumulators, each x load folded into its FMA. */
#define TILE_R 4
#define TILE_R_FEW 4
#define TILE_C 4
#define X_ELEM float
const char *q4_isa(void) { return "avx512f"; }
static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    /* 32 bf16 inputs load as sixteen lanes of two; lane 4L + j takes the pair 4j + L (inputs
     * 8j + 2L and 8j + 2L + 1), whose first shifted up is that input in fp32 and whose second is
     * the lane with its low half cleared. */
    const __m512i pairs = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int64_t i = 0; i < n; i += 32) {
        __m512i v = _mm512_permutexvar_epi32(pairs, _mm512_loadu_si512(x + i));
        _mm512_storeu_si512(xw + i, _mm512_slli_epi32(v, 16));
        _mm512_storeu_si512(xw + i + 16, _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    }
}

static inline __attribute__((always_inline)) void tile(const struct q4 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const float *x = (const float *)q->x + c0 * q->xstride;
    const int64_t nb = q->n / 2, sbytes = q->kind == SCALE_F32 ? 4 : 2;
    /* Lane 4L + j takes byte L of the chunk's word j: its nibbles are inputs 8j + 2L, 8j + 2L + 1. */
    const __m512i shift_lo = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    const __m512i shift_hi = _mm512_add_epi32(shift_lo, _mm512_set1_epi32(4));
    const __m512 iota = _mm512_set_ps(15.f, 14.f, 13.f, 12.f, 11.f, 10.f, 9.f, 8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f, 1.f, 0.f);
    __m512 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    /* Sixteen groups' scales and zero points per row, as fp32, refilled every sixteen groups. */
    float sg[TILE_R][16] __attribute__((aligned(64))), zg[TILE_R][16] __attribute__((aligned(64)));
    /* As the AVX-512 BF16 tile: the next tile's scales and zero points prefetched a line per 128
     * inputs of this one, its weights pf_bytes (whole tiles) ahead, none past the weight's end. */
    const char *snext = (const char *)q->s + (r0 + R) * q->ng * sbytes, *znext = q->z ? (const char *)(q->z + (r0 + R) * q->ng) : NULL;
    const int64_t rnext = r0 + R < q->rows ? min64(TILE_R, q->rows - r0 - R) : 0;
    const uint64_t sleft = (uint64_t)(rnext * q->ng * sbytes), zleft = q->z ? (uint64_t)(rnext * q->ng) : 0;
    const int64_t pf = (r0 + R) * nb + q->pf_bytes <= q->rows * nb ? q->pf_bytes : 0;
    const uint8_t *row[TILE_R];
    UNROLL for (int r = 0; r < R; r++) row[r] = q->w + (r0 + r) * nb;
    for (int64_t g0 = 0; g0 < q->ng; g0 += 16) {
        const int64_t count = min64(16, q->ng - g0);
        const __mmask16 gm = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        UNROLL for (int r = 0; r < R; r++) {
            _mm512_store_ps(sg[r], scales16(q->s, q->kind, (r0 + r) * q->ng + g0, count));
            __m512 z = q->z ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, q->z + (r0 + r) * q->ng + g0))) : _mm512_set1_ps(8.f);
            _mm512_store_ps(zg[r], z);
        }
        for (int64_t g = g0; g < g0 + count; g++) {
            __m512 table[TILE_R];
            UNROLL for (int r = 0; r < R; r++)
                table[r] = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zg[r][g - g0])), _mm512_set1_ps(sg[r][g - g0]));
            /* Unsigned offsets and the rows' own pointers: the loop's bookkeeping took issue
             * slots the vector work needs. */
            for (uint64_t e = (uint64_t)(g * q->group), end = e + (uint64_t)q->group; e < end; e += 32) {
                const uint64_t b = e / 2;
                if ((e & 127) == 0) {
                    if (b < sleft) _mm_prefetch(snext + b, _MM_HINT_T0);
                    if (b < zleft) _mm_prefetch(znext + b, _MM_HINT_T0);
                    /* With no prefetch asked for (pf 0), the line about to be read: a no-op. */
                    UNROLL for (int r = 0; r < R; r++) prefetch_weight((const char *)row[r] + pf + b, q->pf_where);
                }
                UNROLL for (int r = 0; r < R; r++) {
                    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row[r] + b)));
                    __m512 lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift_lo), table[r]);
                    __m512 hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift_hi), table[r]);
                    UNROLL for (int c = 0; c < C; c++) {
                        acc[r][c] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + c * q->xstride + e), acc[r][c]);
                        acc[r][c] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + c * q->xstride + e + 16), acc[r][c]);
                    }
                }
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) o[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* Sixteen inputs at a time: eight bytes widen to eight 32-bit lanes, whose low nibbles are the
 * even inputs and high nibbles the odd ones; the group's zero (8, or its zero point) comes off in
 * integers and the difference, exact, is converted to fp32. x is widened to fp32 once per call in
 * the same order (per 16 inputs, the 8 even then the 8 odd). Four weight rows against one x row,
 * or one weight row against four x rows (TILE_R_FEW), fill the sixteen registers. */
#define TILE_R 4
#define TILE_R_FEW 1
#define TILE_C 4
#define X_ELEM float
const char *q4_isa(void) { return "avx2"; }
static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < n; i += 16)
        for (int64_t j = 0; j < 8; j++) {
            xw[i + j] = bf16_to_f32(x[i + 2 * j]);
            xw[i + 8 + j] = bf16_to_f32(x[i + 2 * j + 1]);
        }
}

static inline __attribute__((always_inline)) void tile(const struct q4 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    const float *x = (const float *)q->x + c0 * q->xstride;
    const int64_t nb = q->n / 2, sbytes = q->kind == SCALE_F32 ? 4 : 2;
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m256 acc[TILE_R][TILE_C];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    /* As the AVX-512 tile: the next rows' scales prefetched now, their weights step by step when
     * asked. */
    if (r0 + R < q->rows)
        for (int64_t b = 0; b < min64(TILE_R, q->rows - r0 - R) * q->ng * sbytes; b += 64) {
            _mm_prefetch((const char *)q->s + (r0 + R) * q->ng * sbytes + b, _MM_HINT_T0);
            if (q->z && b < q->ng * R) _mm_prefetch((const char *)(q->z + (r0 + R) * q->ng) + b, _MM_HINT_T0);
        }
    const int64_t pf = (r0 + R) * nb + q->pf_bytes <= q->rows * nb ? q->pf_bytes : 0;
    for (int64_t g = 0; g < q->ng; g++) {
        /* Even and odd inputs in two sums per pair: one chain of FMAs per pair ran at their
         * latency, not their rate. */
        __m256 ge[TILE_R][TILE_C], go[TILE_R][TILE_C], sv[TILE_R];
        __m256i zero[TILE_R];
        UNROLL for (int r = 0; r < R; r++) {
            zero[r] = _mm256_set1_epi32(q->z ? q->z[(r0 + r) * q->ng + g] : 8);
            UNROLL for (int c = 0; c < C; c++) ge[r][c] = go[r][c] = _mm256_setzero_ps();
        }
        for (int64_t e = g * q->group; e < (g + 1) * q->group; e += 16) {
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *p = q->w + (r0 + r) * nb + e / 2;
                if (pf && (e & 127) == 0) prefetch_weight((const char *)p + pf, q->pf_where);
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
                __m256 fl = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, low), zero[r]));
                __m256 fh = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), zero[r]));
                UNROLL for (int c = 0; c < C; c++) {
                    ge[r][c] = _mm256_fmadd_ps(fl, _mm256_loadu_ps(x + c * q->xstride + e), ge[r][c]);
                    go[r][c] = _mm256_fmadd_ps(fh, _mm256_loadu_ps(x + c * q->xstride + e + 8), go[r][c]);
                }
            }
        }
        UNROLL for (int r = 0; r < R; r++) {
            sv[r] = _mm256_set1_ps(scale_at(q->s, q->kind, (r0 + r) * q->ng + g));
            UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(_mm256_add_ps(ge[r][c], go[r][c]), sv[r], acc[r][c]);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) {
            o[r][c] = hsum8(acc[r][c]);
        }
}

#else
/* Each group's values (q - zero) once into fp32, then their dot product with each x row. */
#define TILE_R 1
#define TILE_R_FEW 1
#define TILE_C 4
#define X_ELEM float
const char *q4_isa(void) { return "scalar"; }
static void prepare_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < n; i++) xw[i] = bf16_to_f32(x[i]);
}

static inline void tile(const struct q4 *q, int64_t r0, int64_t c0, int R, int C, float o[TILE_R][TILE_C]) {
    (void)R;
    const float *x = (const float *)q->x + c0 * q->xstride;
    const uint8_t *w = q->w + r0 * (q->n / 2);
    float acc[TILE_C] = {0.f, 0.f, 0.f, 0.f}, v[32];
    for (int64_t g = 0; g < q->ng; g++) {
        float z = q->z ? (float)q->z[r0 * q->ng + g] : 8.f, s = scale_at(q->s, q->kind, r0 * q->ng + g);
        float d[TILE_C] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t e = g * q->group; e < (g + 1) * q->group; e += 32) {
            for (int j = 0; j < 16; j++) {
                v[2 * j] = (float)(w[e / 2 + j] & 0x0f) - z;
                v[2 * j + 1] = (float)(w[e / 2 + j] >> 4) - z;
            }
            UNROLL for (int c = 0; c < C; c++)
                for (int j = 0; j < 32; j++) d[c] += v[j] * x[c * q->xstride + e + j];
        }
        UNROLL for (int c = 0; c < C; c++) acc[c] += d[c] * s;
    }
    UNROLL for (int c = 0; c < C; c++) o[0][c] = acc[c];
}
#endif

#ifndef ZERO_TERM_NEEDED
/* Every path but the BF16 one takes the zero off per value (or has it in its table), and reads x
 * in rows of n: no zero term, no padding. */
#define ZERO_TERM_NEEDED(z) 0
static float zero_term(const struct q4 *q, int64_t r, int64_t c) { /* never called */
    (void)q, (void)r, (void)c;
    return 0.f;
}
static int64_t x_stride(int64_t n) { return n; }
#endif

#define TILE_Q struct q4
#include "run_tile.h"
#undef TILE_Q

/* Tile (r0, c0) of q4_gemm's call: its outputs, less the zero term where the path needs it. */
struct q4_call {
    struct q4 q;
    uint16_t *y;
    int64_t m;
};
static void q4_tile(const void *ctx, int64_t r0, int R, int64_t c0, int C) {
    const struct q4_call *k = ctx;
    float o[TILE_R][TILE_C];
    run_tile(&k->q, r0, c0, R, C, o);
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int c = 0; c < C; c++) {
            float v = o[r][c];
            if (k->q.xsum) v -= zero_term(&k->q, r0 + r, c0 + c);
            k->y[(c0 + c) * k->q.rows + r0 + r] = f32_to_bf16(v);
        }
}

/* y [m, rows] = x [m, n] W^T. prefetch: at least how many bytes ahead of each weight load it is
 * prefetched from, 0 for none; where: where those lines go (quant.h prefetch_weight). Returns 0, or -1 when the scratch for x could not be allocated (nothing
 * written). */
int q4_gemm(const struct q4_weight *wt, const uint16_t *x, uint16_t *y, int64_t m, int64_t prefetch, int64_t where) {
    const int64_t rows = wt->rows, n = wt->n, group = wt->group;
    struct q4_call k = {{wt->w, wt->s, wt->kind, wt->z, rows, n, group, n / group, prefetch, where, NULL, x_stride(n), NULL}, y, m};
    size_t xbytes = ((size_t)(m * k.q.xstride) * sizeof(X_ELEM) + 63) & ~(size_t)63;
    size_t sbytes = ZERO_TERM_NEEDED(wt->z) ? (size_t)(m * k.q.ng) * sizeof(float) : 0;
    char *buf = scratch(xbytes + sbytes);
    if (buf == NULL) return -1;
    float *xs = sbytes ? (float *)(buf + xbytes) : NULL;
    for (int64_t c = 0; c < m; c++) {
        prepare_x(x + c * n, n, (X_ELEM *)buf + c * k.q.xstride);
        if (xs) group_sums(x + c * n, n, group, xs + c * k.q.ng);
    }
    k.q.x = buf, k.q.xsum = xs;
    /* Weight rows per tile: the tile may take fewer when it also takes several x rows. */
    const int64_t tr = m == 1 ? TILE_R : TILE_R_FEW, tile_bytes = tr * (n / 2);
    k.q.pf_bytes = whole_tiles(prefetch, tile_bytes);
    run_tiles(&k, q4_tile, rows, m, tr, TILE_C, wt->w, tile_bytes, k.q.pf_bytes);
    return 0;
}
