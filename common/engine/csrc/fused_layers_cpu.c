/* Every decoder layer of a small fp32 step in one call: the same kernels the eager layers call, in
 * the same order on the same values, without Python between them.
 *
 * Why: a decode step of a small model is a few hundred kernel calls of tens of microseconds each,
 * and between two of them the eager forward spends ~5-10 us of Python (module calls, views, checks,
 * ctypes argument conversion) on one core while the other idles: on Gemma 3 270M with int8
 * weights, 8 rows, about a quarter of the step.  Here the kernels are called through the function
 * pointers the Python side found for the eager path (csrc/norm_rope_cpu.c, gated_activation_cpu.c,
 * paged_attention_cpu.c and each weight's product: int8_vnni_cpu.c, int4_vnni_cpu.c,
 * int8_gemv_cpu.c -- int8 where int8_vnni_cpu.c has no build -- or panel_gemm_cpu.c), so the result is the
 * eager forward's to the last bit (common/engine/models/fused_layers.py says when it applies).
 *
 * A layer (x: the residual stream [rows, hidden], updated in place):
 *   h = norm(x, input_norm); qkv = h Wqkv^T (+ bias)
 *   q = rope(norm(q, q_norm)), k = rope(norm(k, k_norm))   (no q/k norms: rope alone)
 *   K/V cache[slot_blocks[t], slot_offsets[t]] = k[t], v[t]; a = attention(q, cache)
 *   o = a Wo^T (+ bias)
 *   sandwich (Gemma): x = x + norm(o, post_attention_norm); h = norm(x, pre_feedforward_norm)
 *   otherwise:        x = x + o;                              h = norm(x, post_attention_norm)
 *   d = (act(gate) * up)(h Wgate_up^T) Wdown^T
 *   sandwich: x = x + norm(d, post_feedforward_norm); otherwise x = x + d
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#define PRODUCT_VNNI8 0 /* fn(x, rows, in, w0, w1, y, out, group) -> int */
#define PRODUCT_VNNI4 1 /* fn(x, rows, in, w0, w1, w2, y, out, group) -> int */
#define PRODUCT_PANEL 2 /* fn(x, ldx, w0, rows, out, in, y, ldy, threads) */
#define PRODUCT_GEMV8 3 /* fn(x, rows, w0, w1, y, out, in) */

typedef int (*vnni8_fn)(const float *, int64_t, int64_t, const void *, const void *, float *, int64_t, int64_t);
typedef int (*vnni4_fn)(const float *, int64_t, int64_t, const void *, const void *, const void *, float *, int64_t,
                        int64_t);
typedef void (*gemv8_fn)(const float *, int64_t, const void *, const void *, float *, int64_t, int64_t);
typedef void (*panel_fn)(const float *, int64_t, const void *, int64_t, int64_t, int64_t, float *, int64_t, int);
typedef int (*norm_rope_fn)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, const float *, float,
                            const float *, int64_t, const float *, const float *, int64_t, float *, int);
typedef int (*activation_fn)(const float *, int64_t, int64_t, int64_t, int, float *, int);
typedef int (*attention_fn)(int, int, const void *, int64_t, int64_t, const void *, const void *, int64_t, int64_t,
                            int64_t, void *, const int32_t *, int64_t, const int32_t *, const int32_t *, int, int, int,
                            int, int, int, float, int, int);

typedef struct {
    int32_t kind;
    void *fn;
    const void *w[3];
    const float *bias; /* [out] or NULL */
    int64_t in, out, group;
} product_t;

typedef struct {
    product_t qkv, o, gate_up, down;
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm;
    const float *q_norm, *k_norm; /* NULL: none */
    void *key_cache, *value_cache;
    int32_t window, rope; /* rope: which of the step's cos/sin tables */
    float scale;
} layer_t;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, activation, sandwich;
    float eps;
    int32_t block_size, cache_elem;  /* cache_elem: bytes a cached value, 4 (fp32), 2 (bf16) or 1 (fp8) */
    int64_t s_block, s_slot, s_head; /* the caches' strides, in values */
    int64_t num_blocks;              /* the caches' blocks (a slot's bound) */
    void *norm_rope, *gated_activation, *attention;
    const layer_t *layers;
} model_t;

typedef struct {
    const float *const *cos, *const *sin; /* by layer_t.rope: [rows, head_dim] each, row stride s_cs */
    int64_t s_cs;
    const int64_t *slot_blocks, *slot_offsets;
    const int32_t *table, *query_start, *context_lens;
    int64_t table_stride;
    int32_t num_requests, max_context, threads;
} step_t;

static int product(const product_t *p, const float *x, int64_t rows, float *y, int threads) {
    int rc = 0;
    if (p->kind == PRODUCT_VNNI8)
        rc = ((vnni8_fn)p->fn)(x, rows, p->in, p->w[0], p->w[1], y, p->out, p->group);
    else if (p->kind == PRODUCT_VNNI4)
        rc = ((vnni4_fn)p->fn)(x, rows, p->in, p->w[0], p->w[1], p->w[2], y, p->out, p->group);
    else if (p->kind == PRODUCT_PANEL)
        ((panel_fn)p->fn)(x, p->in, p->w[0], rows, p->out, p->in, y, p->out, threads);
    else if (p->kind == PRODUCT_GEMV8)
        ((gemv8_fn)p->fn)(x, rows, p->w[0], p->w[1], y, p->out, p->in);
    else
        return -3;
    if (rc == 0 && p->bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < p->out; n++) y[r * p->out + n] += p->bias[n];
    return rc;
}

/* out = norm(x) (+ residual) for [rows, dim] rows (norm_rope's plain form). */
static int norm_rows(const model_t *m, const float *x, int64_t rows, int64_t dim, const float *w, const float *residual,
                     float *out, int threads) {
    return ((norm_rope_fn)m->norm_rope)(x, rows, 1, dim, 0, dim, w, m->eps, residual, dim, NULL, NULL, 0, out, threads);
}

static void add_rows(float *x, const float *y, int64_t values) {
    for (int64_t i = 0; i < values; i++) x[i] = x[i] + y[i];
}

static int one_layer(const model_t *m, const layer_t *l, const step_t *s, float *x, float *spare, int64_t rows,
                     float *h, float *qkv, float *q, float *k, float *attended, float *gu, float *act) {
    const int t = s->threads, H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, hidden = m->hidden;
    const int64_t qkv_width = (int64_t)(H + 2 * KVH) * D;
    const float *cos = s->cos[l->rope], *sin = s->sin[l->rope];
    int rc = norm_rows(m, x, rows, hidden, l->input_norm, NULL, h, t);
    if (!rc) rc = product(&l->qkv, h, rows, qkv, t);
    /* q and k: [tokens, heads, D] views of qkv's rows, normed and rotated into contiguous copies */
    if (!rc) rc = ((norm_rope_fn)m->norm_rope)(qkv, rows * H, H, qkv_width, D, D, l->q_norm, m->eps, NULL, 0, cos, sin,
                                               s->s_cs, q, t);
    if (!rc) rc = ((norm_rope_fn)m->norm_rope)(qkv + (int64_t)H * D, rows * KVH, KVH, qkv_width, D, D, l->k_norm, m->eps,
                                               NULL, 0, cos, sin, s->s_cs, k, t);
    if (rc) return rc;
    const int ce = m->cache_elem;
    /* the new tokens' keys and values into their cache slots (v: a view of qkv's rows) */
    if (store_kv_rows(l->key_cache, l->value_cache, ce, m->num_blocks, m->block_size, m->s_block, m->s_slot,
                      m->s_head, s->slot_blocks, s->slot_offsets, k, (int64_t)KVH * D, qkv + (int64_t)(H + KVH) * D,
                      qkv_width, rows, KVH, D))
        return -4;
    rc = ((attention_fn)m->attention)(4, ce, q, (int64_t)H * D, D, l->key_cache, l->value_cache, m->s_block,
                                      m->s_slot, m->s_head, attended, s->table, s->table_stride, s->query_start,
                                      s->context_lens, s->num_requests, H, KVH, D, m->block_size, l->window, l->scale,
                                      s->max_context, t);
    if (!rc) rc = product(&l->o, attended, rows, h, t); /* o into h */
    if (rc) return rc;
    const int64_t values = rows * hidden;
    float *ffn_in = qkv; /* free again: the MLP's normed input */
    if (m->sandwich) {
        rc = norm_rows(m, h, rows, hidden, l->post_attention_norm, x, spare, t); /* x + norm(o) */
        if (!rc) memcpy(x, spare, sizeof(float) * values);
        if (!rc) rc = norm_rows(m, x, rows, hidden, l->pre_feedforward_norm, NULL, ffn_in, t);
    } else {
        add_rows(x, h, values);
        rc = norm_rows(m, x, rows, hidden, l->post_attention_norm, NULL, ffn_in, t);
    }
    if (!rc) rc = product(&l->gate_up, ffn_in, rows, gu, t);
    if (!rc) rc = ((activation_fn)m->gated_activation)(gu, rows, m->intermediate, 2 * (int64_t)m->intermediate,
                                                       m->activation, act, t);
    if (!rc) rc = product(&l->down, act, rows, h, t); /* down into h */
    if (rc) return rc;
    if (m->sandwich) {
        rc = norm_rows(m, h, rows, hidden, l->post_feedforward_norm, x, spare, t);
        if (!rc) memcpy(x, spare, sizeof(float) * values);
    } else {
        add_rows(x, h, values);
    }
    return rc;
}

static int64_t widest(const model_t *m) {
    int64_t w = m->hidden;
    const int64_t candidates[] = {(int64_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim,
                                  (int64_t)m->num_heads * m->head_dim, 2 * (int64_t)m->intermediate};
    for (int i = 0; i < 3; i++) w = candidates[i] > w ? candidates[i] : w;
    return w;
}

/* x [rows, hidden] (fp32, contiguous) through every layer, in place.  Returns 0; -1 where scratch
 * could not be allocated; otherwise the failing kernel's code (-2 / -3: a layout it refuses). */
int fused_layers(const model_t *m, float *x, int64_t rows, const step_t *s) {
    const int64_t wide = widest(m), hidden = m->hidden;
    const int64_t q_values = (int64_t)m->num_heads * m->head_dim, k_values = (int64_t)m->num_kv_heads * m->head_dim;
    /* h and spare: hidden (and o / down outputs, hidden wide); qkv: the widest product (also the
     * MLP's normed input); q, attended: heads x D; k; gu: 2 x intermediate; act: intermediate */
    const int64_t per_row = 2 * hidden + wide + 2 * q_values + k_values + 2 * (int64_t)m->intermediate +
                            m->intermediate;
    float *scratch = malloc(sizeof(float) * (size_t)(per_row * rows + 16));
    if (scratch == NULL) return -1;
    float *h = scratch, *spare = h + rows * hidden, *qkv = spare + rows * hidden, *q = qkv + rows * wide;
    float *attended = q + rows * q_values, *k = attended + rows * q_values, *gu = k + rows * k_values;
    float *act = gu + rows * 2 * (int64_t)m->intermediate;
    int rc = 0;
    for (int i = 0; i < m->num_layers && rc == 0; i++)
        rc = one_layer(m, &m->layers[i], s, x, spare, rows, h, qkv, q, k, attended, gu, act);
    free(scratch);
    return rc;
}
