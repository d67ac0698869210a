/* bf16 projections on weights held in panels: W [rows, n] stored as ceil(rows / 64) panels of 64
 * rows, each panel input-major ([n][64]: the 64 rows' weights for input k, then for k + 1), rows
 * past the last whole panel zero. One output is then one lane of a vector, and each is summed as
 * one fp32 chain of fused multiply-adds over its inputs in order, whatever the call: one row (a
 * decode step), a few (a decode step of several sequences) or many (a prefill) give a row the same
 * bits (tests/test_panels.py holds them so).
 *
 * Why (docs/batching.md, panels): with rows in lanes, a one-row product keeps eight independent
 * chains going while reading one stream, where a row-major row keeps two; and a few-row product
 * broadcasts each x element against a whole weight vector, so a tile of four x rows by sixteen
 * weight rows holds eight sums and reads one weight load and four broadcasts per eight FMAs, which
 * the row-major tiles (two sums per pair, x rows as full vectors) cannot on AVX2's sixteen
 * registers.
 *
 * Inside a panel, input k's 64 weights are four groups of 16 rows, each group one 256-bit load:
 * its 32-bit lane j holds row j in the low half and row 8 + j in the high half, so shifting each
 * lane left by 16 widens rows 0-7 to fp32 and masking off the low half widens rows 8-15, with no
 * shuffle. Built where the compiler targets AVX2 with FMA; elsewhere panel_bf16_isa says why not
 * and nothing is offered.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"
#include "../scratch.h"
#include "../threads.h"

#define PANEL 64 /* rows a panel holds */

/* Where row r's weight for input k lies in a panel (r < PANEL). */
static inline int64_t lane_of(int64_t r) {
    const int64_t group = r / 16, j = r % 16;
    return group * 16 + (j < 8 ? 2 * j : 2 * (j - 8) + 1);
}

/* Inputs k0..n of panel q's rows packed one weight at a time (rows past `rows` zero). */
static void pack_scalar(const uint16_t *w, uint16_t *out, int64_t q, int64_t rows, int64_t n, int64_t k0) {
    for (int64_t r = 0; r < PANEL; r++) {
        const int64_t row = q * PANEL + r, at = lane_of(r);
        for (int64_t k = k0; k < n; k++) out[k * PANEL + at] = row < rows ? w[row * n + k] : 0;
    }
}

/* panels -> w [rows, n] row-major (panel_pack_bf16 undone). */
void panel_unpack_bf16(const uint16_t *p, uint16_t *w, int64_t rows, int64_t n) {
    const int64_t panels = (rows + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++)
        for (int64_t k0 = 0; k0 < n; k0 += 64) {
            const int64_t k1 = k0 + 64 < n ? k0 + 64 : n;
            for (int64_t row = q * PANEL; row < rows && row < (q + 1) * PANEL; row++) {
                const uint16_t *in = p + q * n * PANEL + lane_of(row % PANEL);
                for (int64_t k = k0; k < k1; k++) w[row * n + k] = in[k * PANEL];
            }
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

const char *panel_bf16_isa(void) { return "avx2"; }

static inline __m256 low_rows(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 high_rows(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }

/* Eight rows of eight 32-bit elements transposed in registers: c[i] holds element i of each. */
static inline void transpose8(const __m256 r[8], __m256 c[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) c[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), c[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

/* Panel q packed sixteen inputs at a time: for each group of 16 rows, rows j and 8 + j
 * interleaved by 16-bit unpacks (the pair a lane holds), then the eight pairs of each input
 * gathered by an 8x8 transpose of 32-bit elements. The inputs past the last sixteen, scalar. */
static void pack_panel(const uint16_t *w, uint16_t *out, int64_t q, int64_t rows, int64_t n) {
    /* Which input of the sixteen each transposed element is: 16-bit unpacks work within each
     * 128-bit half (inputs 0-7 and 8-15), low then high four. */
    static const int at[2][8] = {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16)
        for (int g = 0; g < 4; g++) {
            __m256i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t row = q * PANEL + 16 * g + i;
                r[i] = row < rows ? _mm256_loadu_si256((const __m256i *)(w + row * n + k)) : _mm256_setzero_si256();
            }
            __m256 pairs[2][8], cols[8];
            for (int j = 0; j < 8; j++) {
                pairs[0][j] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(r[j], r[j + 8]));
                pairs[1][j] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(r[j], r[j + 8]));
            }
            for (int h = 0; h < 2; h++) {
                transpose8(pairs[h], cols);
                for (int c = 0; c < 8; c++) _mm256_storeu_ps((float *)(out + (k + at[h][c]) * PANEL + 16 * g), cols[c]);
            }
        }
    pack_scalar(w, out, q, rows, n, k);
}

/* w [rows, n] row-major -> panels [ceil(rows / 64) * n * 64], rows past `rows` zero. */
void panel_pack_bf16(const uint16_t *w, uint16_t *p, int64_t rows, int64_t n) {
    const int64_t panels = (rows + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++) pack_panel(w, p + q * n * PANEL, q, rows, n);
}

/* x [m, n] bf16 widened to fp32 (exact) into xw. */
static void widen(const uint16_t *x, float *xw, int64_t count) {
    for (int64_t i = 0; i < count; i++) xw[i] = bf16_to_f32(x[i]);
}

/* Eight fp32 lanes rounded to bf16 into y, only the first `valid` (a panel's last rows may be
 * padding). */
static inline void store_rows(__m256 v, uint16_t *y, int64_t valid) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int64_t i = 0; i < 8 && i < valid; i++) y[i] = f32_to_bf16(f[i]);
}

/* A panel's eight sums (acc, 64 fp32) carried over inputs k0..k1 for x widened (xw). */
static inline __attribute__((always_inline)) void panel_run(const uint16_t *w, const float *xw, int64_t k0, int64_t k1, float *acc) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int64_t k = k0; k < k1; k++) {
        const uint16_t *wk = w + k * PANEL;
        const __m256 xb = _mm256_broadcast_ss(xw + k);
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wk + 16 * g));
            a[2 * g] = _mm256_fmadd_ps(low_rows(v), xb, a[2 * g]);
            a[2 * g + 1] = _mm256_fmadd_ps(high_rows(v), xb, a[2 * g + 1]);
        }
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

#define MAX_STREAMS 4
/* y [rows] = W x for one bf16 row x: each thread a contiguous range of panels, read as `streams`
 * (1..4) streams at once, a block of `block` inputs of each in turn (4 KiB of a panel at 32),
 * each panel feeding eight chains: one stream per core reads memory below what two or four do
 * (docs/batching.md, panels). The sums wait in L1 between blocks; each output is still one chain
 * over its inputs in order. */
void panel_gemv_bf16(const uint16_t *p, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t streams, int64_t block) {
    if (streams < 1 || streams > MAX_STREAMS) streams = 1;
    if (block < 1) block = n;
    float *xw = scratch((size_t)n * sizeof(float));
    if (xw == NULL) { /* no memory for x widened: widen each input as it is read */
        const int64_t panels = (rows + PANEL - 1) / PANEL;
        for (int64_t q = 0; q < panels; q++)
            for (int64_t r = 0; r < PANEL && q * PANEL + r < rows; r++) {
                const uint16_t *in = p + q * n * PANEL + lane_of(r);
                float s = 0.f;
                for (int64_t k = 0; k < n; k++) s = fmaf(bf16_to_f32(in[k * PANEL]), bf16_to_f32(x[k]), s);
                y[q * PANEL + r] = f32_to_bf16(s);
            }
        return;
    }
    widen(x, xw, n);
    const int64_t panels = (rows + PANEL - 1) / PANEL;
#pragma omp parallel
    {
        int64_t q0, q1;
        thread_units(panels, &q0, &q1);
        const int64_t per = (q1 - q0 + streams - 1) / streams;
        float acc[MAX_STREAMS][PANEL] __attribute__((aligned(32)));
        for (int64_t i = 0; i < per; i++) {
            int64_t qs[MAX_STREAMS];
            int m = 0;
            for (int64_t s = 0; s < streams; s++)
                if (q0 + s * per + i < q1) qs[m++] = q0 + s * per + i;
            memset(acc, 0, sizeof acc);
            for (int64_t k0 = 0; k0 < n; k0 += block) {
                const int64_t k1 = k0 + block < n ? k0 + block : n;
                for (int s = 0; s < m; s++) panel_run(p + qs[s] * n * PANEL, xw, k0, k1, acc[s]);
            }
            for (int s = 0; s < m; s++)
                for (int j = 0; j < 8; j++) store_rows(_mm256_load_ps(acc[s] + 8 * j), y + qs[s] * PANEL + 8 * j, rows - qs[s] * PANEL - 8 * j);
        }
    }
}

/* One group of 16 weight rows (g) against C <= 6 x rows over inputs k0..k1: the sums carried in
 * acc ([C][PANEL] fp32, this group's 16 lanes), each x element broadcast against the group's two
 * widened vectors. Every `every` inputs one 64-byte line of the weight is asked for into L1, from
 * pf on: a share of the next block of inputs, which the passes over this block spread evenly
 * between them so the memory keeps streaming while the caches serve them. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, const float *x, int64_t n, int64_t k0, int64_t k1, float *acc, int C, const char *pf, int64_t every) {
    __m256 lo[6], hi[6];
    for (int i = 0; i < C; i++) lo[i] = _mm256_loadu_ps(acc + i * PANEL), hi[i] = _mm256_loadu_ps(acc + i * PANEL + 8);
    int64_t left = every;
    for (int64_t k = k0; k < k1; k++) {
        if (--left == 0) _mm_prefetch(pf, _MM_HINT_T0), pf += 64, left = every;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k * PANEL));
        const __m256 wl = low_rows(v), wh = high_rows(v);
        for (int i = 0; i < C; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * n + k);
            lo[i] = _mm256_fmadd_ps(wl, xb, lo[i]);
            hi[i] = _mm256_fmadd_ps(wh, xb, hi[i]);
        }
    }
    for (int i = 0; i < C; i++) _mm256_storeu_ps(acc + i * PANEL, lo[i]), _mm256_storeu_ps(acc + i * PANEL + 8, hi[i]);
}

static inline __attribute__((always_inline)) void run_tile(const uint16_t *w, const float *x, int64_t n, int64_t k0, int64_t k1, float *acc, int C, const char *pf, int64_t every) {
    /* Constant row counts, so the sums stay in registers. */
    switch (C) {
        case 6: tile(w, x, n, k0, k1, acc, 6, pf, every); break;
        case 5: tile(w, x, n, k0, k1, acc, 5, pf, every); break;
        case 4: tile(w, x, n, k0, k1, acc, 4, pf, every); break;
        case 3: tile(w, x, n, k0, k1, acc, 3, pf, every); break;
        case 2: tile(w, x, n, k0, k1, acc, 2, pf, every); break;
        default: tile(w, x, n, k0, k1, acc, 1, pf, every); break;
    }
}

/* Panels run together against each block of x in the many-row product: past FEW_ROWS x rows,
 * x's block (kb inputs of every row) is big enough that reading it again for every panel costs
 * more than the panels' blocks leaving L1 between x groups (docs/batching.md, panels). */
#define FEW_ROWS 16
#define PANELS_TOGETHER 4

/* Y [m, rows] = X [m, n] W^T: each thread a contiguous range of panels, one at a time (a few x
 * rows) or PANELS_TOGETHER at a time (a prompt's rows); a block of `kb` inputs of each (kb * 128
 * bytes, in L1) runs over every x row, `mr` (1..6) rows by 16 weight rows at a time, the sums
 * carried from block to block. Where the buffer for x widened and the sums cannot grow, each row
 * through panel_gemv_bf16 (the same bits). */
void panel_gemm_bf16(const uint16_t *p, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t mr, int64_t kb) {
    if (mr < 1 || mr > 6) mr = 4;
    if (kb < 16) kb = 16;
    const int64_t together = m > FEW_ROWS ? PANELS_TOGETHER : 1;
    const int threads = max_threads();
    const size_t xbytes = ((size_t)(m * n) * sizeof(float) + 63) / 64 * 64, per = (size_t)(together * m * PANEL);
    float *xw = scratch(xbytes + (size_t)threads * per * sizeof(float));
    if (xw == NULL) {
        for (int64_t c = 0; c < m; c++) panel_gemv_bf16(p, x + c * n, y + c * rows, rows, n, 1, n);
        return;
    }
    widen(x, xw, m * n);
    float *sums = (float *)((char *)xw + xbytes);
    const int64_t panels = (rows + PANEL - 1) / PANEL, groups = (m + mr - 1) / mr;
#pragma omp parallel num_threads(threads)
    {
        int64_t q0, q1;
        thread_units(panels, &q0, &q1);
        float *acc = sums + (size_t)thread_index() * per;
        for (int64_t q = q0; q < q1; q += together) {
            const int64_t count = q1 - q < together ? q1 - q : together;
            memset(acc, 0, (size_t)(count * m * PANEL) * sizeof(float));
            for (int64_t k0 = 0; k0 < n; k0 += kb) {
                const int64_t k1 = k0 + kb < n ? k0 + kb : n;
                /* Each panel's next block (it follows this one in memory, into the next panel at
                 * the end), shared out over that panel's 4 x groups passes over this block. */
                const int64_t lines = (2 * (k1 - k0) + 4 * groups - 1) / (4 * groups);
                const int64_t every = (k1 - k0) / lines > 0 ? (k1 - k0) / lines : 1;
                for (int64_t c0 = 0; c0 < m; c0 += mr) {
                    const int C = (int)(m - c0 < mr ? m - c0 : mr);
                    const int64_t pass = c0 / mr * 4;
                    for (int64_t j = 0; j < count; j++) {
                        const uint16_t *w = p + (q + j) * n * PANEL;
                        const char *next = (const char *)(w + k1 * PANEL);
                        float *a = acc + (j * m + c0) * PANEL;
                        for (int g = 0; g < 4; g++)
                            run_tile(w + 16 * g, xw + c0 * n, n, k0, k1, a + 16 * g, C, next + (pass + g) * lines * 64, every);
                    }
                }
            }
            for (int64_t j = 0; j < count; j++)
                for (int64_t c = 0; c < m; c++)
                    for (int i = 0; i < 8; i++) {
                        const int64_t r = (q + j) * PANEL + 8 * i;
                        store_rows(_mm256_loadu_ps(acc + (j * m + c) * PANEL + 8 * i), y + c * rows + r, rows - r);
                    }
        }
    }
}

#else
const char *panel_bf16_isa(void) { return "unavailable: the CPU (or the compiler) has no AVX2 with FMA"; }
void panel_pack_bf16(const uint16_t *w, uint16_t *p, int64_t rows, int64_t n) {
    const int64_t panels = (rows + PANEL - 1) / PANEL;
    for (int64_t q = 0; q < panels; q++) pack_scalar(w, p + q * n * PANEL, q, rows, n, 0);
}
void panel_gemv_bf16(const uint16_t *p, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t streams, int64_t block) {
    (void)p, (void)x, (void)y, (void)rows, (void)n, (void)streams, (void)block;
}
void panel_gemm_bf16(const uint16_t *p, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t mr, int64_t kb) {
    (void)p, (void)x, (void)y, (void)rows, (void)n, (void)m, (void)mr, (void)kb;
}
#endif
