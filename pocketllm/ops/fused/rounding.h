/* The scalar pieces the fused decode kernels share: bf16 rounding where the torch path rounds,
 * and the activations, all in fp32. */
#ifndef POCKETLLM_FUSED_ROUNDING_H
#define POCKETLLM_FUSED_ROUNDING_H
#include <math.h>
#include <stdint.h>

#include "../bf16.h"

static inline float bf(uint16_t h) { return bf16_to_f32(h); }

static inline uint16_t to_bf(float f) { return f32_to_bf16(f); }

/* bf16 rounding of an fp32 value, kept as fp32. */
static inline float rbf(float f) { return bf(to_bf(f)); }

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* rsqrt(mean(x^2) + eps) over n fp32 values. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.0f / sqrtf(s / (float)n + eps);
}
#endif
