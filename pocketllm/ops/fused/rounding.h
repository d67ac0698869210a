/* The scalar pieces the fused decode kernels share: bf16 rounding where the torch path rounds,
 * and the activations, all in fp32. */
#ifndef POCKETLLM_FUSED_ROUNDING_H
#define POCKETLLM_FUSED_ROUNDING_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../bf16.h"

static inline float bf(uint16_t h) { return bf16_to_f32(h); }

static inline uint16_t to_bf(float f) { return f32_to_bf16(f); }

/* bf16 rounding of an fp32 value, kept as fp32. */
static inline float rbf(float f) { return bf(to_bf(f)); }

/* c ? a : b as a blend of bits. A float select written with ?: is a branch GCC will not vectorize
 * without AVX-512's masks while a comparison may trap (the default -ftrapping-math), so on AVX2
 * every loop over exp_fast ran scalar; a comparison's value and bit operations vectorize as a
 * compare and a blend. A NaN compares false, as with ?:. */
static inline float select_f32(int c, float a, float b) {
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    const uint32_t m = -(uint32_t)c;
    const uint32_t r = (ua & m) | (ub & ~m);
    float f;
    memcpy(&f, &r, 4);
    return f;
}

/* exp(x) within about 2 ulp of fp32, as straight-line arithmetic so that a loop over it
 * vectorizes (a call to the C library's expf does not, and those calls were almost all of a
 * decode row's SiLU-and-multiply: docs/measuring.md, figures behind the code's choices): 2^n
 * exp(r) with |r| <= ln2 / 2, n rounded to nearest by the 1.5 * 2^23 trick, exp(r) by a degree-7
 * polynomial (Cephes' coefficients), 2^n put in the exponent field. */
static inline float exp_fast(float x) {
    x = select_f32(x < -87.0f, -87.0f, x);
    x = select_f32(x > 88.0f, 88.0f, x);
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

static inline float silu(float x) { return x / (1.0f + exp_fast(-x)); }

static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_fast(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* rsqrt(mean(x^2) + eps) over n fp32 values. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.0f / sqrtf(s / (float)n + eps);
}
#endif
