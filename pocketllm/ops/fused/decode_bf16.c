/* The work between a bf16 decode step's GEMVs, one call per block instead of dozens of torch ops.
 *
 * Each function does what the torch path in pocketllm/ops/fused/reference.py does, rounding to
 * bf16 at the same points (torch computes a bf16 op in fp32 and rounds its result), so the two
 * differ only by fp32 summation order. One decode row is tiny work; what these calls save is the
 * per-op dispatch, and the cache refill each torch op pays after a GEMV has streamed its weight
 * through the core's caches.
 */
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
static float inv_rms(const float *x, int64_t n, float eps) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.0f / sqrtf(s / (float)n + eps);
}

/* h_out = bf16(h + x) (x may be NULL: h_out = h), y = bf16(h_out * rsqrt(mean(h_out^2) + eps) * scale). */
void add_rms_norm_bf16(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, uint16_t *h_out, uint16_t *y) {
    /* The sum is exact in bf16 once rounded, so the second pass reads it back from h_out (or h). */
    const uint16_t *sum = x ? h_out : h;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = x ? rbf(bf(h[i]) + bf(x[i])) : bf(h[i]);
        if (x) h_out[i] = to_bf(v);
        s += v * v;
    }
    const float r = 1.0f / sqrtf(s / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = to_bf(bf(sum[i]) * r * scale[i]);
}

/* out = bf16(bf16(silu(gate)) * up). */
void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    /* Split over the threads from a few thousand values: each takes tens of ns (expf), a
     * parallel region a few us. */
#pragma omp parallel for schedule(static) if (n >= 2048)
    for (int64_t i = 0; i < n; i++) out[i] = to_bf(rbf(silu(bf(gate[i]))) * bf(up[i]));
}

/* The Gated DeltaNet block of one decode row, from its in-projection to the input of out_proj.
 * proj: [conv_ch | z (hv*dv) | b (hv) | a (hv)] bf16, conv_ch = 2*hk*dk + hv*dv
 * taps: [K, conv_ch] fp32; conv_state: [K-1, conv_ch] bf16, advanced in place
 * neg_a: [hv] fp32 (-exp(A_log)); dt_bias: [hv] bf16; norm_w: [dv] bf16
 * state: [hv, dk, dv] fp32, advanced in place; out: [hv*dv] bf16
 * work: fp32 scratch of conv_ch + 2*hv + hv*dv floats. */
void gdn_decode_bf16(const uint16_t *proj, const float *taps, uint16_t *conv_state, const float *neg_a, const uint16_t *dt_bias,
                     const uint16_t *norm_w, float eps, float *state, uint16_t *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                     int64_t kernel, float *work) {
    const int64_t kd = hk * dk, vd = hv * dv, conv_ch = 2 * kd + vd;
    const uint16_t *z = proj + conv_ch, *b = z + vd, *a = b + hv;
    float *mixed = work, *beta = work + conv_ch, *g = beta + hv, *o = g + hv;

    /* Causal conv step: the newest input times the last tap, then the older ones in order, summed
     * in fp32, rounded, SiLU, rounded; the window moves on by one. */
    for (int64_t c = 0; c < conv_ch; c++) {
        float x = bf(proj[c]);
        float acc = x * taps[(kernel - 1) * conv_ch + c];
        for (int64_t i = 0; i < kernel - 1; i++) acc += bf(conv_state[i * conv_ch + c]) * taps[i * conv_ch + c];
        for (int64_t i = 0; i + 1 < kernel - 1; i++) conv_state[i * conv_ch + c] = conv_state[(i + 1) * conv_ch + c];
        conv_state[(kernel - 2) * conv_ch + c] = proj[c];
        mixed[c] = rbf(silu(rbf(acc)));
    }
    /* q and k l2-normalised per head in fp32; q then scaled by dk^-0.5. */
    const float qscale = (float)(1.0 / sqrt((double)dk));
    for (int64_t h = 0; h < 2 * hk; h++) {
        float *x = mixed + h * dk, s = 0.0f;
        for (int64_t i = 0; i < dk; i++) s += x[i] * x[i];
        float r = 1.0f / sqrtf(s + 1e-6f);
        for (int64_t i = 0; i < dk; i++) x[i] = h < hk ? (x[i] * r) * qscale : x[i] * r;
    }
    for (int64_t h = 0; h < hv; h++) {
        beta[h] = rbf(sigmoid(bf(b[h])));
        g[h] = neg_a[h] * softplus(bf(a[h]) + bf(dt_bias[h]));
    }
    const float *q = mixed, *k = mixed + kd, *v = mixed + 2 * kd;
    const int64_t group = hv / hk;
    /* Split over the threads from a quarter MiB of state: the state comes from memory (a step's
     * weights streamed through the caches since the last call), tens of us a head. */
#pragma omp parallel for schedule(static) if (hv * dk * dv >= (1 << 16))
    for (int64_t j = 0; j < hv; j++) {
        const float *qj = q + (j / group) * dk, *kj = k + (j / group) * dk;
        float *S = state + j * dk * dv, *oj = o + j * dv;
        float kv[dv > 0 ? dv : 1], delta[dv > 0 ? dv : 1];
        const float decay = expf(g[j]);
        for (int64_t e = 0; e < dv; e++) kv[e] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            for (int64_t e = 0; e < dv; e++) {
                row[e] *= decay;
                kv[e] += kj[i] * row[e];
            }
        }
        for (int64_t e = 0; e < dv; e++) {
            delta[e] = (v[j * dv + e] - kv[e]) * beta[j];
            oj[e] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            for (int64_t e = 0; e < dv; e++) {
                row[e] += kj[i] * delta[e];
                oj[e] += qj[i] * row[e];
            }
        }
    }
    /* Gated RMSNorm per value head, rounding where the torch path rounds. */
    for (int64_t j = 0; j < hv; j++) {
        float *oj = o + j * dv;
        for (int64_t e = 0; e < dv; e++) oj[e] = rbf(oj[e]);
        float r = inv_rms(oj, dv, eps);
        for (int64_t e = 0; e < dv; e++) {
            float normed = rbf(oj[e] * r);
            out[j * dv + e] = to_bf(silu(bf(z[j * dv + e])) * rbf(bf(norm_w[e]) * normed));
        }
    }
}

/* Gated attention of one decode row at position pos, from its fused q|k|v projection to the input
 * of o_proj. qkv: [H*2d (query and gate interleaved per head) | kvh*d | kvh*d] bf16;
 * q_scale, k_scale: [d] fp32 (1 + w of q_norm, k_norm); cos, sin: [half] fp32 for this position;
 * k_pool, v_pool: [blocks, kvh, bs, d] bf16, the layer's KV blocks; table: the sequence's block ids
 * (position t is row t % bs of block table[t / bs]), row pos written here; out: [H*d] bf16;
 * work: fp32 scratch of H*d + kvh*d + H*(pos+1) floats. */
void attention_decode_bf16(const uint16_t *qkv, const float *q_scale, const float *k_scale, float eps, const float *cos,
                           const float *sin, uint16_t *k_pool, uint16_t *v_pool, const int32_t *table, int64_t bs, int64_t pos,
                           int64_t heads, int64_t kvh, int64_t d, int64_t half, float scale, uint16_t *out, float *work) {
    const uint16_t *kp = qkv + heads * 2 * d, *vp = kp + kvh * d;
    const int64_t s_len = pos + 1, group = heads / kvh;
    float *q = work, *k = q + heads * d, *scores = k + kvh * d;
    /* Per head: zero-centred RMSNorm (rounded), then the rotation of the first 2*half dims in
     * fp32 (rounded). */
    for (int64_t h = 0; h < heads + kvh; h++) {
        const uint16_t *src = h < heads ? qkv + h * 2 * d : kp + (h - heads) * d;
        const float *sc = h < heads ? q_scale : k_scale;
        float *x = h < heads ? q + h * d : k + (h - heads) * d;
        for (int64_t i = 0; i < d; i++) x[i] = bf(src[i]);
        float r = inv_rms(x, d, eps);
        for (int64_t i = 0; i < d; i++) x[i] = rbf(x[i] * r * sc[i]);
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[half + i];
            x[i] = rbf(x1 * cos[i] - x2 * sin[i]);
            x[half + i] = rbf(x2 * cos[i] + x1 * sin[i]);
        }
    }
    const int64_t last = ((int64_t)table[pos / bs] * kvh * bs + pos % bs) * d;
    for (int64_t h = 0; h < kvh; h++)
        for (int64_t i = 0; i < d; i++) {
            k_pool[last + h * bs * d + i] = to_bf(k[h * d + i]);
            v_pool[last + h * bs * d + i] = vp[h * d + i];
        }
    /* Split from a few thousand products: a parallel region costs a few us, each head's pass
     * over a short cache already more. */
#pragma omp parallel for schedule(static) if (heads * s_len * d >= (1 << 12))
    for (int64_t h = 0; h < heads; h++) {
        const int64_t kh = h / group;
        const float *qh = q + h * d;
        float *sc = scores + h * s_len, m = -INFINITY, total = 0.0f;
        /* Position order, a block at a time: block b holds positions b*bs .. b*bs+bs-1. */
        for (int64_t b0 = 0; b0 < s_len; b0 += bs) {
            const uint16_t *kc = k_pool + ((int64_t)table[b0 / bs] * kvh + kh) * bs * d;
            const int64_t n = s_len - b0 < bs ? s_len - b0 : bs;
            for (int64_t o = 0; o < n; o++) {
                float dot = 0.0f;
                for (int64_t i = 0; i < d; i++) dot += qh[i] * bf(kc[o * d + i]);
                sc[b0 + o] = dot * scale;
                m = sc[b0 + o] > m ? sc[b0 + o] : m;
            }
        }
        for (int64_t t = 0; t < s_len; t++) {
            sc[t] = expf(sc[t] - m);
            total += sc[t];
        }
        float acc[d > 0 ? d : 1];
        for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
        for (int64_t b0 = 0; b0 < s_len; b0 += bs) {
            const uint16_t *vc = v_pool + ((int64_t)table[b0 / bs] * kvh + kh) * bs * d;
            const int64_t n = s_len - b0 < bs ? s_len - b0 : bs;
            for (int64_t o = 0; o < n; o++) {
                const float p = sc[b0 + o] / total;
                for (int64_t i = 0; i < d; i++) acc[i] += p * bf(vc[o * d + i]);
            }
        }
        const uint16_t *gate = qkv + h * 2 * d + d;
        for (int64_t i = 0; i < d; i++) out[h * d + i] = to_bf(rbf(acc[i]) * rbf(sigmoid(bf(gate[i]))));
    }
}

/* add_rms_norm_bf16 and silu_mul_bf16 on each of `rows` rows, each row by the one-row call, so a
 * row gets the bits it gets alone: a decode step of several sequences. Row r of h, x, h_out and y
 * starts at r * n; of gate and up at r * stride (the halves of one projection's output rows). */
void add_rms_norm_rows_bf16(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, int64_t rows, uint16_t *h_out, uint16_t *y) {
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_bf16(h + r * n, x ? x + r * n : 0, scale, eps, n, x ? h_out + r * n : 0, y + r * n);
}

void silu_mul_rows_bf16(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t n, int64_t rows, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) silu_mul_bf16(gate + r * stride, up + r * stride, out + r * n, n);
}
