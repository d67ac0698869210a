/* A block of rows of a quantized weight as bf16 or fp32, for the many-row kernels, which hand
 * each block to torch's GEMM. Each value is (q - zero) * scale in fp32, the very operations
 * pocketllm/ops/quant/layout.py's dequantize does, so the fp32 block equals its rows exactly; the
 * bf16 block is that rounded once (to nearest even). Plain loops the compiler vectorizes for this
 * CPU (-march=native); rows are split over torch's OpenMP threads. */
#include <stdint.h>

#include "quant.h"

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
