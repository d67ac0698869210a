/* bf16 <-> fp32 for the C kernels under pocketllm/ops: widening is exact, narrowing rounds to
 * nearest even as torch does, and a NaN stays a (quiet) NaN. */
#ifndef POCKETLLM_BF16_H
#define POCKETLLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
