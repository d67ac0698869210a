/* A whole bf16 decode step in one call, of one sequence or of several sequences' rows together:
 * each embedding row through every layer's norms, projections, mixer and MLP, the final norm and
 * the head, to fp32 logits.
 *
 * It computes nothing itself. Each piece is the function the layers call one at a time from Python
 * (decode_bf16.c, attention_bf16.c, the projections' chosen kernels for that many rows), passed in
 * by address and called with the same arguments in the same order, so a step gives the same bits
 * either way (tests/test_compiled_step.py). What it removes is the Python between them: the dozens
 * of module calls and tensor allocations of a step, and the interpreter's own data refilled from
 * memory after every GEMV has streamed its weight through the caches.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "../bf16.h"
#include "../threads.h"

/* A projection's kernel: the bf16 one-row GEMV (gemv_bf16.c), a quantized kernel (ops/quant,
 * taking any number of rows), or a bf16 few-row GEMM (gemv_bf16.c's gemm_rows_*; those that
 * return an int return 1 when chosen, so the value is not read); PROJ_QUANT_EACH is a quantized
 * one-row kernel run on each row of several in turn, as the layers run it then. */
enum { PROJ_BF16 = 0, PROJ_QUANT = 1, PROJ_BF16_ROWS = 2, PROJ_QUANT_EACH = 3 };
typedef void (*bf16_gemv_fn)(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t a, int64_t b);
typedef void (*bf16_rows_fn)(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t a, int64_t b);
typedef int (*quant_gemm_fn)(const void *desc, const uint16_t *x, uint16_t *y, int64_t m, int64_t a, int64_t b);

struct proj {
    int64_t kind;
    void *fn;
    const void *w; /* the bf16 weight [rows, n], or the quantized weight's description */
    int64_t rows, n, a, b;
};

/* The work between the GEMVs (decode_bf16.c, attention_bf16.c): their signatures there. */
typedef void (*add_rms_norm_fn)(const uint16_t *h, const uint16_t *x, const float *scale, float eps, int64_t n, uint16_t *h_out, uint16_t *y);
typedef void (*silu_mul_fn)(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
typedef void (*gdn_decode_fn)(const uint16_t *proj, const float *taps, uint16_t *conv_state, const float *neg_a, const uint16_t *dt_bias,
                              const uint16_t *norm_w, float eps, float *state, uint16_t *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                              int64_t kernel, float *work);
typedef void (*gdn_decode_rows_fn)(const uint16_t *proj, int64_t proj_stride, int64_t rows, const float *taps, uint16_t *const *conv_states,
                                   const float *neg_a, const uint16_t *dt_bias, const uint16_t *norm_w, float eps, float *const *states,
                                   uint16_t *out, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t kernel, float *work);
typedef int (*attention_decode_fn)(const uint16_t *qkv, const float *q_scale, const float *k_scale, float eps, const float *cos, const float *sin,
                                   uint16_t *k_pool, uint16_t *v_pool, int64_t num_blocks, const int32_t *table, int64_t bs, int64_t pos,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t half, float scale, uint16_t *out, float *work,
                                   int64_t splits);

struct layer {
    int64_t full; /* 1: gated attention, 0: Gated DeltaNet */
    const float *in_scale, *post_scale;
    float in_eps, post_eps;
    int64_t inter; /* the MLP's intermediate size (gate_up's rows / 2) */
    /* Gated DeltaNet */
    const float *taps, *neg_a;
    const uint16_t *dt_bias, *norm_w;
    float norm_eps;
    int64_t hk, hv, dk, dv, kernel;
    /* Gated attention */
    const float *q_scale, *k_scale;
    float qk_eps, attn_scale;
    int64_t heads, kv_heads, head_dim, half;
    float *attn_work;
    /* Scratch for one row's attention on one range of blocks, per thread (attn_rows_stride floats
     * each): several rows' attention runs a row per thread. */
    float *attn_rows_work;
    int64_t attn_rows_stride;
};

/* One sequence's state in each layer: a GDN layer's conv window and recurrent state, an attention
 * layer's K and V pools and block table. */
struct seq_layer {
    uint16_t *conv, *k_pool, *v_pool;
    float *state;
    const int32_t *table;
    int64_t num_blocks, block_size;
};

struct step {
    int64_t layers, hidden;
    const struct layer *layer;
    const float *final_scale;
    float final_eps;
    /* The projections' kernels, [(layers * 4 + 1) * rows_max]: layer i's mix_in, mix_out, gate_up
     * and down, then the head, each for 1..rows_max rows (as the layers' bound kernels run that
     * many rows); more rows go rows_max at a time. */
    const struct proj *proj;
    int64_t rows_max;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    gdn_decode_fn gdn_decode;
    gdn_decode_rows_fn gdn_decode_rows; /* a GDN layer's rows in one call, each row's bits gdn_decode's */
    attention_decode_fn attention_decode;
    int64_t threads, attention_parallel_min; /* attention's split over the threads, as kernels.attention_splits */
    /* Scratch for up to `capacity` rows, a row after another: bf16 h, x and y [hidden], the
     * mixer's input projection and the MLP's gate_up [proj_max], the mixer's output and the
     * activation [mid_max], the head's row [vocab]; the GDN's fp32 work (gdn_work_floats a row). */
    int64_t capacity;
    uint16_t *h, *x, *y, *proj_out, *mid, *head_row;
    float *gdn_work;
};

static int project(const struct proj *p, const uint16_t *x, uint16_t *y) {
    if (p->kind == PROJ_BF16) {
        ((bf16_gemv_fn)p->fn)((const uint16_t *)p->w, x, y, p->rows, p->n, p->a, p->b);
        return 0;
    }
    return ((quant_gemm_fn)p->fn)(p->w, x, y, 1, p->a, p->b);
}

/* m rows x [m, n] -> y [m, rows] through one projection's kernel for m rows. */
static int project_rows(const struct proj *p, const uint16_t *x, uint16_t *y, int64_t m) {
    if (p->kind == PROJ_BF16_ROWS) {
        ((bf16_rows_fn)p->fn)((const uint16_t *)p->w, x, y, p->rows, p->n, m, p->a, p->b);
        return 0;
    }
    if (p->kind == PROJ_QUANT) return ((quant_gemm_fn)p->fn)(p->w, x, y, m, p->a, p->b);
    for (int64_t r = 0; r < m; r++)
        if (project(p, x + r * p->n, y + r * p->rows)) return 1;
    return 0;
}

static int64_t attention_splits(const struct step *s, int64_t pos, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    if ((pos + 1) * kv_heads * head_dim < s->attention_parallel_min) return 1;
    const int64_t blocks = pos / block_size + 1;
    return blocks < s->threads ? blocks : s->threads;
}

/* Row r's attention in layer i (attention_decode_bf16 on its sequence's cache), 1 when its block
 * table held ids outside its pool. */
static int attention_row(const struct step *s, const struct layer *l, int64_t r, int64_t i, const int64_t *pos, const float *const *cos,
                         const float *const *sin, const struct seq_layer *const *seq, float *work, int64_t splits) {
    const int64_t in_rows = s->proj[i * 4 * s->rows_max].rows, mid = s->proj[(i * 4 + 1) * s->rows_max].n;
    const struct seq_layer *q = &seq[r][i];
    return s->attention_decode(s->proj_out + r * in_rows, l->q_scale, l->k_scale, l->qk_eps, cos[r], sin[r], q->k_pool, q->v_pool, q->num_blocks,
                               q->table, q->block_size, pos[r], l->heads, l->kv_heads, l->head_dim, l->half, l->attn_scale, s->mid + r * mid,
                               work, splits) != 0;
}

/* Attention layer i of `rows` rows, each its own sequence's. A row whose cache is split over the
 * threads (a long one) runs alone, as it runs in a step of its own; with several rows the rest run
 * a row per thread, each on one range of blocks as it runs alone, so every row gets its own bits
 * either way. Returns 1 when a block table held ids outside its pool. */
static int attention_rows(const struct step *s, const struct layer *l, int64_t rows, int64_t i, const int64_t *pos, const float *const *cos,
                          const float *const *sin, const struct seq_layer *const *seq) {
    int failed = 0;
    const int together = rows > 1 && s->threads > 1 && l->attn_rows_work;
    if (together) {
#pragma omp parallel for schedule(static) reduction(| : failed)
        for (int64_t r = 0; r < rows; r++)
            if (attention_splits(s, pos[r], l->kv_heads, l->head_dim, seq[r][i].block_size) == 1)
                failed |= attention_row(s, l, r, i, pos, cos, sin, seq, l->attn_rows_work + thread_index() * l->attn_rows_stride, 1);
    }
    for (int64_t r = 0; r < rows && !failed; r++) {
        const int64_t splits = attention_splits(s, pos[r], l->kv_heads, l->head_dim, seq[r][i].block_size);
        if (!together || splits > 1) failed = attention_row(s, l, r, i, pos, cos, sin, seq, l->attn_work, splits);
    }
    return failed;
}

/* SiLU-and-multiply of layer l's row r (its gate_up row's two halves). */
static inline void silu_mul_row(const struct step *s, const struct layer *l, int64_t r) {
    const uint16_t *gu = s->proj_out + r * 2 * l->inter;
    s->silu_mul(gu, gu + l->inter, s->mid + r * l->inter, l->inter);
}

/* The same for `rows` rows: several of them a row per thread, one on the calling thread (even a
 * parallel region whose if clause is not taken costs a runtime call). */
static void silu_mul_rows(const struct step *s, const struct layer *l, int64_t rows) {
    if (rows > 1 && s->threads > 1) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++) silu_mul_row(s, l, r);
    } else {
        for (int64_t r = 0; r < rows; r++) silu_mul_row(s, l, r);
    }
}

static int project_set(const struct step *s, int64_t which, const uint16_t *x, uint16_t *y, int64_t rows) {
    const struct proj *first = &s->proj[which * s->rows_max];
    for (int64_t r0 = 0; r0 < rows; r0 += s->rows_max) {
        const int64_t m = rows - r0 < s->rows_max ? rows - r0 : s->rows_max;
        const struct proj *p = &first[m - 1];
        if (project_rows(p, x + r0 * p->n, y + r0 * p->rows, m)) return 1;
    }
    return 0;
}

/* `rows` sequences' decode rows in one call, each its own sequence's next row: row r is the
 * embedding row embed[r] at position pos[r] (cos[r], sin[r] its rotary row), its sequence's state
 * per layer seq[r]; fp32 logits [rows, head rows]. Several rows run each projection's kernel for
 * that many rows, which sums each row as the one-row kernel does where the set is batch-invariant
 * (the only sets that pass several rows here); the work between the projections runs row by row,
 * the same calls (a GDN layer's rows, attention and the activation spread over the threads a row
 * or a head at a time). Returns 0; 1 when a projection failed (its scratch could not be allocated), 2
 * when a block table held ids outside its pool, 3 when `rows` exceeds the scratch's capacity. */
int decode_rows_bf16(const struct step *s, int64_t rows, const uint16_t *const *embed, const int64_t *pos, const float *const *cos,
                     const float *const *sin, const struct seq_layer *const *seq, float *logits) {
    const int64_t n = s->hidden;
    if (rows > s->capacity) return 3;
    for (int64_t r = 0; r < rows; r++) memcpy(s->h + r * n, embed[r], (size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < s->layers; i++) {
        const struct layer *l = &s->layer[i];
        const int64_t in_rows = s->proj[i * 4 * s->rows_max].rows;
        /* The residual stream arrives as h + x (x not yet added in the first layer). */
        for (int64_t r = 0; r < rows; r++)
            s->add_rms_norm(s->h + r * n, i ? s->x + r * n : NULL, l->in_scale, l->in_eps, n, i ? s->h + r * n : NULL, s->y + r * n);
        if (project_set(s, i * 4, s->y, s->proj_out, rows)) return 1;
        if (l->full) {
            if (attention_rows(s, l, rows, i, pos, cos, sin, seq)) return 2;
        } else if (rows == 1) {
            s->gdn_decode(s->proj_out, l->taps, seq[0][i].conv, l->neg_a, l->dt_bias, l->norm_w, l->norm_eps, seq[0][i].state, s->mid, l->hk,
                          l->hv, l->dk, l->dv, l->kernel, s->gdn_work);
        } else {
            uint16_t *conv[rows];
            float *state[rows];
            for (int64_t r = 0; r < rows; r++) conv[r] = seq[r][i].conv, state[r] = seq[r][i].state;
            s->gdn_decode_rows(s->proj_out, in_rows, rows, l->taps, conv, l->neg_a, l->dt_bias, l->norm_w, l->norm_eps, state, s->mid, l->hk, l->hv,
                               l->dk, l->dv, l->kernel, s->gdn_work);
        }
        if (project_set(s, i * 4 + 1, s->mid, s->x, rows)) return 1;
        for (int64_t r = 0; r < rows; r++) s->add_rms_norm(s->h + r * n, s->x + r * n, l->post_scale, l->post_eps, n, s->h + r * n, s->y + r * n);
        if (project_set(s, i * 4 + 2, s->y, s->proj_out, rows)) return 1;
        silu_mul_rows(s, l, rows);
        if (project_set(s, i * 4 + 3, s->mid, s->x, rows)) return 1;
    }
    for (int64_t r = 0; r < rows; r++) s->add_rms_norm(s->h + r * n, s->x + r * n, s->final_scale, s->final_eps, n, s->h + r * n, s->y + r * n);
    if (project_set(s, s->layers * 4, s->y, s->head_row, rows)) return 1;
    const int64_t vocab = s->proj[s->layers * 4 * s->rows_max].rows;
    for (int64_t k = 0; k < rows * vocab; k++) logits[k] = bf16_to_f32(s->head_row[k]);
    return 0;
}

/* One sequence's step: decode_rows_bf16 of one row, its arguments as they are (no arrays for the
 * caller to build per token). */
int decode_step_bf16(const struct step *s, const uint16_t *embed, int64_t pos, const float *cos, const float *sin, const struct seq_layer *seq,
                     float *logits) {
    return decode_rows_bf16(s, 1, &embed, &pos, &cos, &sin, &seq, logits);
}

/* The greedy token of a step's logits: the first index of the largest value, and the first NaN
 * where there is one, as torch.argmax chooses (tests/test_compiled_step.py holds them equal). A
 * loop over logits the step has just written, so the caller need not run a torch op on them. */
static int64_t argmax_scalar(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

/* The same in two vector passes where there is AVX2: the largest value (and whether any is NaN,
 * which the scalar loop then finds), then the first index holding it. The scalar loop's compare
 * chain runs a row of a vocabulary several times slower, and a step of many rows waits on it. */
int64_t logits_argmax(const float *x, int64_t n) {
#ifdef __AVX2__
    if (n >= 8) {
        __m256 top = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        int64_t i = 8;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float lanes[8], m;
        _mm256_storeu_ps(lanes, top);
        m = lanes[0];
        for (int j = 1; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < n; i++) {
            any_nan |= x[i] != x[i];
            m = x[i] > m ? x[i] : m;
        }
        if (any_nan) return argmax_scalar(x, n);
        const __m256 want = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= n; i += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
            if (hit) return i + __builtin_ctz((unsigned)hit);
        }
        for (; i < n; i++)
            if (x[i] == m) return i;
    }
#endif
    return argmax_scalar(x, n);
}

/* logits_argmax of each of `rows` rows of n logits into out: one call for a step's rows. */
void logits_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = logits_argmax(x + r * n, n);
}
