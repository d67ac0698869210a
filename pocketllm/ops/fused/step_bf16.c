/* A whole bf16 decode step of one sequence in one call: the embedding row through every layer's
 * norms, projections, mixer and MLP, the final norm and the head, to fp32 logits.
 *
 * It computes nothing itself. Each piece is the function the layers call one at a time from Python
 * (decode_bf16.c, attention_bf16.c, the projections' chosen one-row kernels), passed in by address
 * and called with the same arguments in the same order, so a step gives the same bits either way
 * (tests/test_compiled_step.py). What it removes is the Python between them: the dozens of module
 * calls and tensor allocations of a step, and the interpreter's own data refilled from memory
 * after every GEMV has streamed its weight through the caches.
 */
#include <stdint.h>
#include <string.h>

#include "../bf16.h"

/* A projection's one-row kernel: the bf16 GEMV (gemv_bf16.c) or a quantized one (ops/quant). */
enum { PROJ_BF16 = 0, PROJ_QUANT = 1 };
typedef void (*bf16_gemv_fn)(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t a, int64_t b);
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
typedef int (*attention_decode_fn)(const uint16_t *qkv, const float *q_scale, const float *k_scale, float eps, const float *cos, const float *sin,
                                   uint16_t *k_pool, uint16_t *v_pool, int64_t num_blocks, const int32_t *table, int64_t bs, int64_t pos,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t half, float scale, uint16_t *out, float *work,
                                   int64_t splits);

struct layer {
    int64_t full; /* 1: gated attention, 0: Gated DeltaNet */
    const float *in_scale, *post_scale;
    float in_eps, post_eps;
    struct proj mix_in, mix_out, gate_up, down;
    int64_t inter; /* the MLP's intermediate size (gate_up's rows / 2) */
    /* Gated DeltaNet */
    const float *taps, *neg_a;
    const uint16_t *dt_bias, *norm_w;
    float norm_eps;
    int64_t hk, hv, dk, dv, kernel;
    float *gdn_work;
    /* Gated attention */
    const float *q_scale, *k_scale;
    float qk_eps, attn_scale;
    int64_t heads, kv_heads, head_dim, half;
    float *attn_work;
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
    struct proj head;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    gdn_decode_fn gdn_decode;
    attention_decode_fn attention_decode;
    int64_t threads, attention_parallel_min; /* attention's split over the threads, as kernels.attention_splits */
    /* Scratch, bf16: h and x [hidden], y [hidden], the mixer's input projection and the MLP's
     * gate_up [proj_max], the mixer's output and the activation [mid_max], the head's row [vocab]. */
    uint16_t *h, *x, *y, *proj, *mid, *head_row;
};

static int project(const struct proj *p, const uint16_t *x, uint16_t *y) {
    if (p->kind == PROJ_BF16) {
        ((bf16_gemv_fn)p->fn)((const uint16_t *)p->w, x, y, p->rows, p->n, p->a, p->b);
        return 0;
    }
    return ((quant_gemm_fn)p->fn)(p->w, x, y, 1, p->a, p->b);
}

static int64_t attention_splits(const struct step *s, int64_t pos, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    if ((pos + 1) * kv_heads * head_dim < s->attention_parallel_min) return 1;
    const int64_t blocks = pos / block_size + 1;
    return blocks < s->threads ? blocks : s->threads;
}

/* One step: `embed` the token's embedding row [hidden], at position `pos` (cos, sin its rotary
 * row), the sequence's state per layer in `seq`; fp32 logits [head rows] into `logits`. Returns 0;
 * 1 when a projection failed (its scratch could not be allocated), 2 when a block table held ids
 * outside its pool. */
int decode_step_bf16(const struct step *s, const uint16_t *embed, int64_t pos, const float *cos, const float *sin, const struct seq_layer *seq,
                     float *logits) {
    const int64_t n = s->hidden;
    memcpy(s->h, embed, (size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < s->layers; i++) {
        const struct layer *l = &s->layer[i];
        const struct seq_layer *q = &seq[i];
        /* The residual stream arrives as h + x (x not yet added in the first layer). */
        s->add_rms_norm(s->h, i ? s->x : NULL, l->in_scale, l->in_eps, n, i ? s->h : NULL, s->y);
        if (project(&l->mix_in, s->y, s->proj)) return 1;
        if (l->full) {
            const int64_t splits = attention_splits(s, pos, l->kv_heads, l->head_dim, q->block_size);
            if (s->attention_decode(s->proj, l->q_scale, l->k_scale, l->qk_eps, cos, sin, q->k_pool, q->v_pool, q->num_blocks, q->table,
                                    q->block_size, pos, l->heads, l->kv_heads, l->head_dim, l->half, l->attn_scale, s->mid, l->attn_work, splits))
                return 2;
        } else {
            s->gdn_decode(s->proj, l->taps, q->conv, l->neg_a, l->dt_bias, l->norm_w, l->norm_eps, q->state, s->mid, l->hk, l->hv, l->dk, l->dv,
                          l->kernel, l->gdn_work);
        }
        if (project(&l->mix_out, s->mid, s->x)) return 1;
        s->add_rms_norm(s->h, s->x, l->post_scale, l->post_eps, n, s->h, s->y);
        if (project(&l->gate_up, s->y, s->proj)) return 1;
        s->silu_mul(s->proj, s->proj + l->inter, s->mid, l->inter);
        if (project(&l->down, s->mid, s->x)) return 1;
    }
    s->add_rms_norm(s->h, s->x, s->final_scale, s->final_eps, n, s->h, s->y);
    if (project(&s->head, s->y, s->head_row)) return 1;
    for (int64_t r = 0; r < s->head.rows; r++) logits[r] = bf16_to_f32(s->head_row[r]);
    return 0;
}

/* The greedy token of a step's logits: the first index of the largest value, and the first NaN
 * where there is one, as torch.argmax chooses (tests/test_compiled_step.py holds them equal). A
 * loop over logits the step has just written, so the caller need not run a torch op on them. */
int64_t logits_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}
