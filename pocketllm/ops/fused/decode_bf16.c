/* The work between a bf16 decode step's GEMVs, one call per block instead of dozens of torch ops.
 *
 * Each function does what the torch path in pocketllm/ops/fused/reference.py does, rounding to
 * bf16 at the same points (torch computes a bf16 op in fp32 and rounds its result), so the two
 * differ only by fp32 summation order. One decode row is tiny work; what these calls save is the
 * per-op dispatch, and the cache refill each torch op pays after a GEMV has streamed its weight
 * through the core's caches.
 */
#include <stdint.h>
#include <string.h>

#include "../threads.h"
#include "rounding.h"

/* State floats (value heads x dk x dv) from which the heads are split over the threads: from a
 * quarter MiB the state comes from memory (a step's weights streamed through the caches since the
 * last call), and a head is then work enough to pay for waking the threads. */
#define GDN_PARALLEL_MIN (1 << 16)
/* How many state rows ahead of the read-only pass its lines are prefetched. */
#define GDN_PREFETCH_ROWS 8

/* h_out = bf16(h + x) (x may be NULL: h_out = h), y = bf16(h_out * rsqrt(mean(h_out^2) + eps) * scale). */
void add_rms_norm_bf16(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, uint16_t *h_out, uint16_t *y) {
    /* The sum is exact in bf16 once rounded, so the second pass reads it back from h_out (or h). */
    const uint16_t *sum = x ? h_out : h;
    float s = 0.0f;
    if (x) {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) {
            const float v = rbf(bf(h[i]) + bf(x[i]));
            h_out[i] = to_bf(v);
            s += v * v;
        }
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += bf(h[i]) * bf(h[i]);
    }
    const float r = 1.0f / sqrtf(s / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = to_bf(bf(sum[i]) * r * scale[i]);
}

/* out = bf16(bf16(silu(gate)) * up). */
void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    /* Vectorized (exp_fast), a decode row is a few microseconds' work on one thread: not split over
     * the threads, since even a parallel region whose if clause is not taken costs a runtime call,
     * which alone was most of the call's time (docs/decode.md). */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = to_bf(rbf(silu(bf(gate[i]))) * bf(up[i]));
}

/* The gated RMSNorm of one value head's dv values x (bf16), as the torch form (ops/norms.py
 * rms_norm_gated) rounds it: normed = bf16(x * rsqrt(mean(x^2) + eps)), out = bf16(silu(z) *
 * bf16(w * normed)). out may be x. */
static inline void gated_norm_row(const uint16_t *x, const uint16_t *z, const uint16_t *w, float eps, int64_t dv, uint16_t *out) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < dv; e++) s += bf(x[e]) * bf(x[e]);
    const float r = 1.0f / sqrtf(s / (float)dv + eps);
#pragma omp simd
    for (int64_t e = 0; e < dv; e++) out[e] = to_bf(silu(bf(z[e])) * rbf(bf(w[e]) * rbf(bf(x[e]) * r)));
}

/* The causal conv's fp32 sums for row r of x [t, ch] (rows xstride apart): the newest input times
 * the last tap, then the older ones in order (window row r + i: the state's [kernel-1, ch] before x
 * starts, else x's), a tap at a time over every channel so each loop vectorizes. A decode row is
 * row 0 of a one-row x; a prompt segment's rows are conv_row's. */
static inline void conv_sums(const uint16_t *x, int64_t xstride, int64_t r, int64_t ch, const float *taps, int64_t kernel,
                             const uint16_t *conv_state, float *acc) {
    const uint16_t *now = x + r * xstride;
#pragma omp simd
    for (int64_t c = 0; c < ch; c++) acc[c] = bf(now[c]) * taps[(kernel - 1) * ch + c];
    for (int64_t i = 0; i < kernel - 1; i++) {
        const int64_t j = r + i - (kernel - 1);
        const uint16_t *past = j >= 0 ? x + j * xstride : conv_state + (r + i) * ch;
        const float *tap = taps + i * ch;
#pragma omp simd
        for (int64_t c = 0; c < ch; c++) acc[c] += bf(past[c]) * tap[c];
    }
}

/* The Gated DeltaNet block of one decode row, from its in-projection to the input of out_proj.
 * proj: [conv_ch | z (hv*dv) | b (hv) | a (hv)] bf16, conv_ch = 2*hk*dk + hv*dv
 * taps: [K, conv_ch] fp32; conv_state: [K-1, conv_ch] bf16, advanced in place
 * neg_a: [hv] fp32 (-exp(A_log)); dt_bias: [hv] bf16; norm_w: [dv] bf16
 * state: [hv, dk, dv] fp32, advanced in place; out: [hv*dv] bf16
 * work: fp32 scratch of conv_ch + 2*hv + hv*dv floats (gdn_work_floats).
 * In three parts, which the several-row form below runs for each row as this one does: the
 * row's conv and gates, each value head's recurrence, the gated norm. */
/* Exported: the Python side sizes the scratch it passes by it (kernels.gdn_work). */
int64_t gdn_work_floats(int64_t hk, int64_t hv, int64_t dk, int64_t dv) { return 2 * hk * dk + 2 * hv * dv + 2 * hv; }

/* The conv step (its sums in fp32, rounded, SiLU, rounded; the window moves on by one), q and k
 * l2-normalised per head in fp32 (q then scaled by dk^-0.5), beta and the log decay g, into work. */
static void gdn_row_inputs(const uint16_t *proj, const float *taps, uint16_t *conv_state, const float *neg_a, const uint16_t *dt_bias,
                           int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel, float *work) {
    const int64_t kd = hk * dk, vd = hv * dv, conv_ch = 2 * kd + vd;
    const uint16_t *b = proj + conv_ch + vd, *a = b + hv;
    float *mixed = work, *beta = work + conv_ch, *g = beta + hv;
    conv_sums(proj, conv_ch, 0, conv_ch, taps, kernel, conv_state, mixed);
    if (kernel > 1) {
        memmove(conv_state, conv_state + conv_ch, (size_t)((kernel - 2) * conv_ch) * sizeof(uint16_t));
        memcpy(conv_state + (kernel - 2) * conv_ch, proj, (size_t)conv_ch * sizeof(uint16_t));
    }
#pragma omp simd
    for (int64_t c = 0; c < conv_ch; c++) mixed[c] = rbf(silu(rbf(mixed[c])));
    const float qscale = (float)(1.0 / sqrt((double)dk));
    for (int64_t h = 0; h < 2 * hk; h++) {
        float *x = mixed + h * dk, s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dk; i++) s += x[i] * x[i];
        float r = 1.0f / sqrtf(s + 1e-6f);
        for (int64_t i = 0; i < dk; i++) x[i] = h < hk ? (x[i] * r) * qscale : x[i] * r;
    }
    for (int64_t h = 0; h < hv; h++) {
        beta[h] = rbf(sigmoid(bf(b[h])));
        g[h] = neg_a[h] * softplus(bf(a[h]) + bf(dt_bias[h]));
    }
}

/* Value head j's recurrence: its output into work's o, its state [dk, dv] advanced in place.
 * Two passes over the head's fp32 state, the most a step can do with it: one read of the old
 * state for k^T S and q^T S together, then one read-write for S' = decay S + k (x) delta. With
 * that S', k^T (decay S) = decay k^T S and q^T S' = decay q^T S + (q . k) delta. */
static void gdn_head(float *work, float *state, int64_t j, int64_t hk, int64_t hv, int64_t dk, int64_t dv, const float *next) {
    const int64_t kd = hk * dk, vd = hv * dv, conv_ch = 2 * kd + vd;
    const float *q = work, *k = work + kd, *v = work + 2 * kd, *beta = work + conv_ch, *g = beta + hv;
    float *o = work + conv_ch + 2 * hv;
    const int64_t group = hv / hk;
    const float *qj = q + (j / group) * dk, *kj = k + (j / group) * dk;
    float *S = state + j * dk * dv, *oj = o + j * dv;
    float ks[dv > 0 ? dv : 1], qs[dv > 0 ? dv : 1], delta[dv > 0 ? dv : 1];
    const float decay = expf(g[j]);
    float qk = 0.0f;
    for (int64_t i = 0; i < dk; i++) qk += qj[i] * kj[i];
    for (int64_t e = 0; e < dv; e++) ks[e] = 0.0f, qs[e] = 0.0f;
    /* The thread's next head (`next`, NULL at the end of its share) is asked for, for writing,
     * into L2, spread evenly over both passes' iterations: the memory keeps streaming while this
     * head works from the caches (its second pass entirely from L2). */
    const int64_t total = dk * dv, steps = dk / 4 + dk;
    int64_t ahead = 0, step = 0;
#define GDN_PREFETCH_NEXT()                                                          \
    if (next)                                                                        \
        for (const int64_t upto = ++step * total / steps; ahead < upto; ahead += 16) \
            __builtin_prefetch(next + ahead, 1, 2);
    /* Four rows a pass over ks and qs: they live in memory (dv is not a constant), and one row at
     * a time their loads and stores, not the state's, were the loop's cost. */
    int64_t i = 0;
    for (; i + 4 <= dk; i += 4) {
        GDN_PREFETCH_NEXT()
        const float *r0 = S + i * dv, *r1 = r0 + dv, *r2 = r1 + dv, *r3 = r2 + dv;
        const float k0 = kj[i], k1 = kj[i + 1], k2 = kj[i + 2], k3 = kj[i + 3];
        const float q0 = qj[i], q1 = qj[i + 1], q2 = qj[i + 2], q3 = qj[i + 3];
        /* The state streams from memory once a step: its lines are asked for ahead, a few rows at
         * a time (the hardware's prefetch alone left the read well below the memory's rate). */
        for (int64_t off = 0; off < 4 * dv; off += 16) __builtin_prefetch(r0 + GDN_PREFETCH_ROWS * dv + off, 0, 3);
#pragma omp simd
        for (int64_t e = 0; e < dv; e++) {
            ks[e] += (k0 * r0[e] + k1 * r1[e]) + (k2 * r2[e] + k3 * r3[e]);
            qs[e] += (q0 * r0[e] + q1 * r1[e]) + (q2 * r2[e] + q3 * r3[e]);
        }
    }
    for (; i < dk; i++) {
        const float *row = S + i * dv, ki = kj[i], qi = qj[i];
#pragma omp simd
        for (int64_t e = 0; e < dv; e++) {
            ks[e] += ki * row[e];
            qs[e] += qi * row[e];
        }
    }
    for (int64_t e = 0; e < dv; e++) {
        delta[e] = (v[j * dv + e] - decay * ks[e]) * beta[j];
        oj[e] = decay * qs[e] + qk * delta[e];
    }
    for (i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = kj[i];
        GDN_PREFETCH_NEXT()
        for (int64_t e = 0; e < dv; e++) row[e] = decay * row[e] + ki * delta[e];
    }
#undef GDN_PREFETCH_NEXT
}

/* The heads' output rounded to bf16 (as the torch path hands it to the norm), then the gated norm
 * per value head in place. */
static void gdn_row_output(const uint16_t *proj, const float *work, const uint16_t *norm_w, float eps, int64_t hk, int64_t hv, int64_t dk,
                           int64_t dv, uint16_t *out) {
    const int64_t vd = hv * dv, conv_ch = 2 * hk * dk + vd;
    const uint16_t *z = proj + conv_ch;
    const float *o = work + conv_ch + 2 * hv;
#pragma omp simd
    for (int64_t e = 0; e < vd; e++) out[e] = to_bf(o[e]);
    for (int64_t j = 0; j < hv; j++) gated_norm_row(out + j * dv, z + j * dv, norm_w, eps, dv, out + j * dv);
}

void gdn_decode_bf16(const uint16_t *proj, const float *taps, uint16_t *conv_state, const float *neg_a, const uint16_t *dt_bias,
                     const uint16_t *norm_w, float eps, float *state, uint16_t *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                     int64_t kernel, float *work) {
    gdn_row_inputs(proj, taps, conv_state, neg_a, dt_bias, hk, hv, dk, dv, kernel, work);
#pragma omp parallel if (hv * dk * dv >= GDN_PARALLEL_MIN)
    {
        int64_t j0, j1;
        thread_units(hv, &j0, &j1);
        for (int64_t j = j0; j < j1; j++) gdn_head(work, state, j, hk, hv, dk, dv, j + 1 < j1 ? state + (j + 1) * dk * dv : NULL);
    }
    gdn_row_output(proj, work, norm_w, eps, hk, hv, dk, dv, out);
}

/* gdn_decode_bf16 for the decode rows of `rows` sequences in one call (a decode step of several
 * sequences): row r's in-projection at proj + r * proj_stride, its conv window and state at
 * conv_states[r] and states[r] (each its own sequence's: no two rows may share one), its output at
 * out + r * hv * dv, its scratch at work + r * gdn_work_floats. Each row goes through the parts
 * gdn_decode_bf16 runs, so it gets the bits it gets alone; the rows' heads are split over the
 * threads together, in one parallel region. */
void gdn_decode_rows_bf16(const uint16_t *proj, int64_t proj_stride, int64_t rows, const float *taps, uint16_t *const *conv_states,
                          const float *neg_a, const uint16_t *dt_bias, const uint16_t *norm_w, float eps, float *const *states, uint16_t *out,
                          int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel, float *work) {
    const int64_t floats = gdn_work_floats(hk, hv, dk, dv), vd = hv * dv;
#pragma omp parallel if (rows * hv * dk * dv >= GDN_PARALLEL_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            gdn_row_inputs(proj + r * proj_stride, taps, conv_states[r], neg_a, dt_bias, hk, hv, dk, dv, kernel, work + r * floats);
        /* The threads' shares of the rows' heads, contiguous (as schedule(static) splits them):
         * each head knows the next one it runs. */
        int64_t u0, u1;
        thread_units(rows * hv, &u0, &u1);
        for (int64_t rj = u0; rj < u1; rj++) {
            const int64_t nx = rj + 1;
            gdn_head(work + (rj / hv) * floats, states[rj / hv], rj % hv, hk, hv, dk, dv, nx < u1 ? states[nx / hv] + (nx % hv) * dk * dv : NULL);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) gdn_row_output(proj + r * proj_stride, work + r * floats, norm_w, eps, hk, hv, dk, dv, out + r * vd);
    }
}

/* add_rms_norm_bf16 and silu_mul_bf16 on each of `rows` rows, each row by the one-row call, so a
 * row gets the bits it gets alone: a decode step of several sequences. Row r of h, x, h_out and y
 * starts at r * n; of gate and up at r * stride (the halves of one projection's output rows). */
/* From this many rows (a prompt chunk) the rows are split over the threads. A decode step's few
 * rows stay on the calling thread in a loop with no parallel region in it: a region that is not
 * taken still costs a runtime call, which alone was most of a decode row's SiLU. */
#define ROWS_PARALLEL_MIN 32
static void add_rms_norm_rows_parallel(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, int64_t rows, uint16_t *h_out, uint16_t *y) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_bf16(h + r * n, x ? x + r * n : 0, scale, eps, n, x ? h_out + r * n : 0, y + r * n);
}

void add_rms_norm_rows_bf16(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, int64_t rows, uint16_t *h_out, uint16_t *y) {
    if (rows >= ROWS_PARALLEL_MIN) {
        add_rms_norm_rows_parallel(h, x, scale, eps, n, rows, h_out, y);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_bf16(h + r * n, x ? x + r * n : 0, scale, eps, n, x ? h_out + r * n : 0, y + r * n);
}

static void silu_mul_rows_parallel(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t n, int64_t rows, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_mul_bf16(gate + r * stride, up + r * stride, out + r * n, n);
}

void silu_mul_rows_bf16(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t n, int64_t rows, uint16_t *out) {
    if (rows >= ROWS_PARALLEL_MIN) {
        silu_mul_rows_parallel(gate, up, stride, n, rows, out);
        return;
    }
    for (int64_t r = 0; r < rows; r++) silu_mul_bf16(gate + r * stride, up + r * stride, out + r * n, n);
}

/* A prompt segment's causal conv + SiLU, as the torch form (ops/causal_conv.py) computes it: per
 * row and channel, the newest input times the last tap, then the older ones in order, summed in
 * fp32, rounded, SiLU, rounded. x [t, ch] bf16 with rows xstride apart (a view of the
 * in-projection's output); taps [kernel, ch] fp32; conv_state [kernel-1, ch] bf16, the inputs
 * before x, advanced in place to the last kernel-1 of state and x; out [t, ch] bf16. Rows depend
 * only on inputs, so they are split over the threads from ROWS_PARALLEL_MIN. */
static inline void conv_row(const uint16_t *x, int64_t xstride, int64_t r, int64_t ch, const float *taps, int64_t kernel,
                            const uint16_t *conv_state, uint16_t *out) {
    float acc[ch > 0 ? ch : 1];
    conv_sums(x, xstride, r, ch, taps, kernel, conv_state, acc);
#pragma omp simd
    for (int64_t c = 0; c < ch; c++) out[r * ch + c] = to_bf(silu(rbf(acc[c])));
}

static void conv_rows_parallel(const uint16_t *x, int64_t xstride, int64_t t, int64_t ch, const float *taps, int64_t kernel,
                               const uint16_t *conv_state, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < t; r++) conv_row(x, xstride, r, ch, taps, kernel, conv_state, out);
}

void conv_silu_rows_bf16(const uint16_t *x, int64_t xstride, int64_t t, int64_t ch, const float *taps, int64_t kernel,
                         uint16_t *conv_state, uint16_t *out) {
    if (t >= ROWS_PARALLEL_MIN)
        conv_rows_parallel(x, xstride, t, ch, taps, kernel, conv_state, out);
    else
        for (int64_t r = 0; r < t; r++) conv_row(x, xstride, r, ch, taps, kernel, conv_state, out);
    /* The window's last kernel-1 rows become the state: x's last rows, after the state's own
     * remaining ones when x is shorter. */
    const int64_t keep = kernel - 1;
    if (keep <= 0) return;
    const int64_t from_state = t >= keep ? 0 : keep - t;
    if (from_state) memmove(conv_state, conv_state + t * ch, (size_t)(from_state * ch) * sizeof(uint16_t));
    for (int64_t i = from_state; i < keep; i++)
        memcpy(conv_state + i * ch, x + (t - keep + i) * xstride, (size_t)ch * sizeof(uint16_t));
}

/* A prompt segment's gated RMSNorm per value head (gated_norm_row). x [rows, dv] bf16 contiguous
 * (rows = tokens x heads); z [rows, dv] bf16, the heads of a token dv apart and tokens zstride
 * apart (a view of the in-projection's output, hv heads a token); out [rows, dv] bf16. */
static void gated_norm_rows_parallel(const uint16_t *x, const uint16_t *z, int64_t zstride, int64_t hv, const uint16_t *w, float eps,
                                     int64_t dv, int64_t rows, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) gated_norm_row(x + i * dv, z + (i / hv) * zstride + (i % hv) * dv, w, eps, dv, out + i * dv);
}

void rms_norm_gated_rows_bf16(const uint16_t *x, const uint16_t *z, int64_t zstride, int64_t hv, const uint16_t *w, float eps, int64_t dv,
                              int64_t rows, uint16_t *out) {
    if (rows >= ROWS_PARALLEL_MIN * hv) {
        gated_norm_rows_parallel(x, z, zstride, hv, w, eps, dv, rows, out);
        return;
    }
    for (int64_t i = 0; i < rows; i++) gated_norm_row(x + i * dv, z + (i / hv) * zstride + (i % hv) * dv, w, eps, dv, out + i * dv);
}
