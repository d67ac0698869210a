/* A block of rows of a quantized weight as bf16 or fp32, for the many-row kernels, which hand
 * each block to torch's GEMM. Each value is (q - zero) * scale in fp32, the very operations
 * pocketllm/ops/quant/layout.py's dequantize does, so the fp32 block equals its rows exactly; the
 * bf16 block is that rounded once (to nearest even). Plain loops the compiler vectorizes for this
 * CPU (-march=native); rows are split over torch's OpenMP threads. */
#include <stdint.h>

#include "quant.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 32 inputs (16 bytes) of one group as fp32 (q - z) * s, in input order: the loop the compiler
 * made of the plain C interleaved the nibbles a value at a time, a quarter of the GEMM's time at
 * 512 rows. */
static inline void q4_values32(const uint8_t *w, __m512 z, __m512 s, __m512 *o0, __m512 *o1) {
    const __m512i even = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i odd = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    __m512 lo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f))), z), s);
    __m512 hi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), z), s);
    *o0 = _mm512_permutex2var_ps(lo, even, hi);
    *o1 = _mm512_permutex2var_ps(lo, odd, hi);
}
#define HAS_Q4_VALUES32 1
#endif

/* Rows r0..r1 of an int4 weight [rows, n/2] into out [r1 - r0, n]. */
void q4_dequant(const uint8_t *w, const void *s, int64_t kind, const uint8_t *z, void *out, int64_t out_f32,
                int64_t r0, int64_t r1, int64_t n, int64_t group) {
    int64_t ng = n / group;
#pragma omp parallel for schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * (n / 2);
        float v[128];
        for (int64_t g = 0; g < ng; g++) {
            float sc = scale_at(s, kind, r * ng + g), zz = z ? (float)z[r * ng + g] : 8.f;
#ifdef HAS_Q4_VALUES32
            if (group % 32 == 0) {
                /* bf16 by vcvtne2ps2bf16: round to nearest even as f32_to_bf16, but a result
                 * below bf16's normal range flushes to zero (no real scale comes near it). */
                for (int64_t e = g * group; e < (g + 1) * group; e += 32) {
                    __m512 a, b;
                    q4_values32(wr + e / 2, _mm512_set1_ps(zz), _mm512_set1_ps(sc), &a, &b);
                    if (out_f32) {
                        float *o = (float *)out + (r - r0) * n + e;
                        _mm512_storeu_ps(o, a);
                        _mm512_storeu_ps(o + 16, b);
                    } else {
                        _mm512_storeu_si512((uint16_t *)out + (r - r0) * n + e, (__m512i)_mm512_cvtne2ps_pbh(b, a));
                    }
                }
                continue;
            }
#endif
            for (int64_t e = g * group; e < (g + 1) * group; e += 128) {
                int64_t len = min64(128, (g + 1) * group - e);
                for (int64_t j = 0; j < len / 2; j++) {
                    v[2 * j] = ((float)(wr[e / 2 + j] & 0x0f) - zz) * sc;
                    v[2 * j + 1] = ((float)(wr[e / 2 + j] >> 4) - zz) * sc;
                }
                if (out_f32) {
                    float *o = (float *)out + (r - r0) * n + e;
                    for (int64_t j = 0; j < len; j++) o[j] = v[j];
                } else {
                    uint16_t *o = (uint16_t *)out + (r - r0) * n + e;
                    for (int64_t j = 0; j < len; j++) o[j] = f32_to_bf16(v[j]);
                }
            }
        }
    }
}

/* Rows r0..r1 of an int8 weight [rows, n] into out [r1 - r0, n]. */
void q8_dequant(const int8_t *w, const void *s, int64_t kind, void *out, int64_t out_f32, int64_t r0, int64_t r1, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = w + r * n;
        float sc = scale_at(s, kind, r);
        if (out_f32) {
            float *o = (float *)out + (r - r0) * n;
            for (int64_t j = 0; j < n; j++) o[j] = (float)wr[j] * sc;
        } else {
            uint16_t *o = (uint16_t *)out + (r - r0) * n;
            for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16((float)wr[j] * sc);
        }
    }
}
