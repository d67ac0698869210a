/* Y = X W^T for bf16 weights W [rows, n] and many bf16 rows X [m, n] (a prefill) on CPUs without
 * bf16 arithmetic (AVX2): fp32 products and sums, each output rounded once to bf16.
 *
 * torch's fp32 GEMM on a widened copy ran at ~57% of two Zen 4 cores' FMA rate held to AVX2 (and
 * the copy cost a third as much again). Here the weight is widened as it is packed, a block of
 * KC inputs of PANELS x 16 rows at a time (each thread its own rows), into vectors whose lanes are
 * weight rows; a tile of six x rows by sixteen weight rows then keeps its twelve sums in registers,
 * two weight loads and six broadcasts of x feeding twelve FMAs per input. Each output is one fp32
 * chain of FMAs over its inputs in order (carried across blocks through a per-thread buffer), so
 * a row's outputs do not depend on the other rows of the call.
 *
 * Built where the compiler targets AVX2 with FMA; elsewhere gemm_f32_isa says why not and
 * gemm_bf16_f32 returns -2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"
#include "threads.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 6       /* x rows a tile takes */
#define NR 16      /* weight rows a tile takes: two vectors */
#define KC 256     /* inputs a packed block holds: PANELS x 16 KiB, in L2 */
#define PANELS 8   /* 16-row panels a thread packs at a time; each x tile runs against all */

const char *gemm_f32_isa(void) { return "avx2"; }

/* Rows r0..r0+NR (zeros past `rows`), inputs k0..k0+kc of bf16 w, as fp32 [kc][NR]. Eight rows
 * by eight inputs at a time: widened, then transposed in registers. */
static void pack(const uint16_t *w, int64_t rows, int64_t n, int64_t r0, int64_t k0, int64_t kc, float *out) {
    for (int h = 0; h < NR; h += 8) {
        const int valid = (int)(rows - r0 - h < 8 ? rows - r0 - h : 8);
        int64_t k = 0;
        for (; k + 8 <= kc; k += 8) {
            __m256 v[8];
            for (int r = 0; r < 8; r++) {
                const __m128i b = r < valid ? _mm_loadu_si128((const __m128i *)(w + (r0 + h + r) * n + k0 + k)) : _mm_setzero_si128();
                v[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
            }
            __m256 t[8], u[8];
            for (int r = 0; r < 8; r += 2) t[r] = _mm256_unpacklo_ps(v[r], v[r + 1]), t[r + 1] = _mm256_unpackhi_ps(v[r], v[r + 1]);
            for (int r = 0; r < 8; r += 4) {
                u[r] = _mm256_shuffle_ps(t[r], t[r + 2], 0x44), u[r + 1] = _mm256_shuffle_ps(t[r], t[r + 2], 0xee);
                u[r + 2] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0x44), u[r + 3] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0xee);
            }
            /* u[j] (j < 4): input k + j of rows 0-3 in its low half, input k + 4 + j in its high
             * half; u[4 + j] the same for rows 4-7. */
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_ps(out + (k + j) * NR + h, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
                _mm256_storeu_ps(out + (k + 4 + j) * NR + h, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
            }
        }
        for (; k < kc; k++)
            for (int r = 0; r < 8; r++) out[k * NR + h + r] = r < valid ? bf16_to_f32(w[(r0 + h + r) * n + k0 + k]) : 0.f;
    }
}

/* x rows (fp32, n apart) against a packed panel [kc][NR]: acc rows ldc apart, C of them, loaded,
 * carried through the block's inputs and stored back. */
static inline __attribute__((always_inline)) void tile(const float *wp, const float *x, int64_t n, int64_t kc, float *acc, int64_t ldc, int C) {
    __m256 c[MR][2];
    for (int i = 0; i < C; i++) c[i][0] = _mm256_loadu_ps(acc + i * ldc), c[i][1] = _mm256_loadu_ps(acc + i * ldc + 8);
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
        for (int i = 0; i < C; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * n + k);
            c[i][0] = _mm256_fmadd_ps(w0, xb, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(w1, xb, c[i][1]);
        }
    }
    for (int i = 0; i < C; i++) _mm256_storeu_ps(acc + i * ldc, c[i][0]), _mm256_storeu_ps(acc + i * ldc + 8, c[i][1]);
}

static void run_tile(const float *wp, const float *x, int64_t n, int64_t kc, float *acc, int64_t ldc, int C) {
    switch (C) {
        case 6: tile(wp, x, n, kc, acc, ldc, 6); break;
        case 5: tile(wp, x, n, kc, acc, ldc, 5); break;
        case 4: tile(wp, x, n, kc, acc, ldc, 4); break;
        case 3: tile(wp, x, n, kc, acc, ldc, 3); break;
        case 2: tile(wp, x, n, kc, acc, ldc, 2); break;
        default: tile(wp, x, n, kc, acc, ldc, 1); break;
    }
}

/* y [m, rows] = x [m, n] W^T. Returns 0; -1 when a buffer could not be allocated (nothing
 * written). */
int gemm_bf16_f32(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m) {
    float *xf = scratch((size_t)(m * n) * sizeof(float));
    if (xf == NULL) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m * n; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t unit = NR * PANELS, units = (rows + unit - 1) / unit, ldc = unit;
    int failed = 0;
#pragma omp parallel
    {
        float *wp = aligned_alloc(64, (size_t)PANELS * KC * NR * sizeof(float));
        float *acc = aligned_alloc(64, (size_t)((m * ldc * sizeof(float) + 63) / 64 * 64));
        if (every_thread(wp != NULL && acc != NULL, &failed)) {
            int64_t u0, u1;
            thread_units(units, &u0, &u1);
            for (int64_t u = u0; u < u1; u++) {
                const int64_t r0 = u * unit, panels = (rows - r0 + NR - 1) / NR < PANELS ? (rows - r0 + NR - 1) / NR : PANELS;
                memset(acc, 0, (size_t)(m * ldc) * sizeof(float));
                for (int64_t k0 = 0; k0 < n; k0 += KC) {
                    const int64_t kc = n - k0 < KC ? n - k0 : KC;
                    for (int64_t p = 0; p < panels; p++) pack(w, rows, n, r0 + p * NR, k0, kc, wp + p * KC * NR);
                    for (int64_t c0 = 0; c0 < m; c0 += MR) {
                        const int C = (int)(m - c0 < MR ? m - c0 : MR);
                        for (int64_t p = 0; p < panels; p++) run_tile(wp + p * KC * NR, xf + c0 * n + k0, n, kc, acc + c0 * ldc + p * NR, ldc, C);
                    }
                }
                const int64_t valid = rows - r0 < unit ? rows - r0 : unit;
                for (int64_t c = 0; c < m; c++)
                    for (int64_t r = 0; r < valid; r++) y[c * rows + r0 + r] = f32_to_bf16(acc[c * ldc + r]);
            }
        }
        free(wp);
        free(acc);
    }
    return failed ? -1 : 0;
}

#else
const char *gemm_f32_isa(void) { return "unavailable: the CPU (or the compiler) has no AVX2 with FMA"; }
int gemm_bf16_f32(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m) {
    (void)w, (void)x, (void)y, (void)rows, (void)n, (void)m;
    return -2;
}
#endif
