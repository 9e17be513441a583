/* Paged attention on CPU that reads the KV cache in place through the block table.
 *
 * One call covers a whole packed step: prompt chunks and decodes of every request.  Work items
 * are (query token, KV head); each runs the GQA group of query heads that share that KV head
 * against the token's visible keys, read straight from the cache blocks (no gather), with a
 * two-pass softmax in fp32 (scores, then max / exp / sum, then the weighted sum of values).
 * Long prompt chunks go in tiles of several tokens' rows instead (paged_attention_tiles.h).
 *
 *   q       [T, H, D]               packed new tokens, D contiguous
 *   cache   [num_blocks, block_size, KVH, D]   per-layer K (or V) view, any block/slot/head strides
 *   out     [T, H, D]               contiguous, q's dtype
 *   table   int32 [R, table_stride] each request's block ids
 *   query_start int32 [R + 1], context_lens int32 [R] (keys after this step, new ones included)
 *
 * q and out are fp32 or bf16 (elem: 4 or 2 bytes a value), the cache fp32, bf16 or fp8 e4m3 (cache_elem:
 * 4, 2 or 1; a bf16 cache under an fp32 model reads half the bytes, an fp8 one a quarter); the
 * arithmetic is fp32 either way.
 *
 * A query at position p sees keys k with k <= p and, with window > 0, k > p - window.
 * Built by common/engine/attention/backend_cpu.py with the system C compiler; loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec16.h"

#define MAX_GROUP 16
/* Keys ahead whose rows are prefetched: a key's row is a few hundred cycles of work, a miss to
 * memory (the blocks are scattered, so the hardware prefetchers lose the stream at each block) about
 * as long: a few keys ahead keep the loads in flight.  Into L2 (locality 1), whose miss queue holds
 * more lines in flight than L1's fill buffers: 16 streams of 210 keys, 560 -> 470 us a layer. */
#define PREFETCH_KEYS 6
/* What the vector path prefetches for an item (attend_vector's `prefetch`): a prompt token whose rows
 * take at most VALUES_AHEAD_MAX_BYTES (K and V each) nothing -- the token before it just read them,
 * they are in cache, and prefetching them again cost (prompts of 256-512 tokens, 18 layers on a
 * Zen 5: attention 1.07-1.10x faster without it, fp32 or bf16 cache, the same values); a decode, or
 * a prompt token over more, the keys ahead in pass 1 and the values ahead in pass 3 (PREFETCH_ROWS);
 * a decode whose rows take at most that also the values during pass 1 (PREFETCH_ROWS_AND_VALUES). */
#define PREFETCH_NONE 0
#define PREFETCH_ROWS 1
#define PREFETCH_ROWS_AND_VALUES 2
/* The vector path prefetches a decode's value rows during its scores pass when they take at most
 * this many bytes (a fraction of a core's L2: 1-2 MB on current x86 cores): on a Zen 4, 8 decodes
 * of ~230 keys, Gemma 3 270M's layout, 3.8 -> 2.85 ms of attention a step. */
#define VALUES_AHEAD_MAX_BYTES (512 * 1024)
#define CACHE_LINE 64

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#include "paged_attention_scalar.h"

/* Start loading the cache row of key `pos` (one KV head's head_dim values). */
static inline void prefetch_row(const char *cache, int64_t off_elems, int elem, int head_dim) {
    const char *row = cache + off_elems * elem;
    for (int b = 0; b < head_dim * elem; b += CACHE_LINE) __builtin_prefetch(row + b, 0, 1);
}

static inline int64_t key_offset(const int32_t *blocks, int pos, int block_size, int64_t s_block, int64_t s_slot,
                                 int64_t s_head, int kv_head) {
    return (int64_t)blocks[pos / block_size] * s_block + (int64_t)(pos % block_size) * s_slot +
           (int64_t)kv_head * s_head;
}

/* The group's output rows: acc[g] / sum[g] for query heads kv_head * group + g, in the output's
 * dtype (elem 2: bf16, rounded to nearest even). */
static inline void write_heads(int elem, void *out_row, const float *acc, const float *inv_sum, int kv_head, int group,
                               int head_dim) {
    for (int g = 0; g < group; g++) {
        const int h = kv_head * group + g;
        const float *a = acc + (int64_t)g * head_dim;
        if (elem == 4) {
            float *dst = (float *)out_row + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) dst[d] = a[d] * inv_sum[g];
        } else {
            bf16_t *dst = (bf16_t *)out_row + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) {
                float f = a[d] * inv_sum[g];
                uint32_t bits;
                memcpy(&bits, &f, sizeof bits);
                bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
                dst[d] = (bf16_t)(bits >> 16);
            }
        }
    }
}

/* One (query token, KV head) item.  elem: q and out, cache_elem: the cache (4 = fp32, 2 = bf16, 1 = fp8). */
static void attend_one(int elem, int cache_elem, const void *q_row, int64_t q_stride_h, const void *k_cache,
                       const void *v_cache, int64_t s_block, int64_t s_slot, int64_t s_head, void *out_row,
                       const int32_t *blocks, int kv_head, int group, int head_dim, int block_size, int first_key,
                       int last_key, float scale, float *scores, float *qf, float *acc) {
    const int n_keys = last_key - first_key + 1;
    /* query heads of this group, in fp32 */
    for (int g = 0; g < group; g++) {
        int h = kv_head * group + g;
        if (elem == 4) {
            memcpy(qf + (int64_t)g * head_dim, (const float *)q_row + h * q_stride_h, sizeof(float) * head_dim);
        } else {
            const bf16_t *src = (const bf16_t *)q_row + h * q_stride_h;
            for (int d = 0; d < head_dim; d++) qf[(int64_t)g * head_dim + d] = bf16_to_f32(src[d]);
        }
    }
    /* pass 1: scores */
    for (int j = 0; j < n_keys; j++) {
        int pos = first_key + j;
        int64_t off = key_offset(blocks, pos, block_size, s_block, s_slot, s_head, kv_head);
        if (j + PREFETCH_KEYS < n_keys)
            prefetch_row(k_cache, key_offset(blocks, pos + PREFETCH_KEYS, block_size, s_block, s_slot, s_head, kv_head),
                         cache_elem, head_dim);
        for (int g = 0; g < group; g++) {
            const float *qg = qf + (int64_t)g * head_dim;
            float s = cache_elem == 4   ? dot_f32(qg, (const float *)k_cache + off, head_dim)
                      : cache_elem == 2 ? dot_bf16(qg, (const bf16_t *)k_cache + off, head_dim)
                                        : dot_fp8(qg, (const uint8_t *)k_cache + off, head_dim);
            scores[(int64_t)g * n_keys + j] = s * scale;
        }
    }
    /* pass 2: softmax weights */
    float inv_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *sc = scores + (int64_t)g * n_keys;
        float m = -INFINITY;
        for (int j = 0; j < n_keys; j++) m = sc[j] > m ? sc[j] : m;
        float sum = 0.0f;
        for (int j = 0; j < n_keys; j++) {
            sc[j] = expf(sc[j] - m);
            sum += sc[j];
        }
        inv_sum[g] = 1.0f / sum;
    }
    /* pass 3: weighted values */
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int j = 0; j < n_keys; j++) {
        int pos = first_key + j;
        int64_t off = key_offset(blocks, pos, block_size, s_block, s_slot, s_head, kv_head);
        if (j + PREFETCH_KEYS < n_keys)
            prefetch_row(v_cache, key_offset(blocks, pos + PREFETCH_KEYS, block_size, s_block, s_slot, s_head, kv_head),
                         cache_elem, head_dim);
        for (int g = 0; g < group; g++) {
            float w = scores[(int64_t)g * n_keys + j];
            if (cache_elem == 4)
                axpy_f32(acc + (int64_t)g * head_dim, w, (const float *)v_cache + off, head_dim);
            else if (cache_elem == 2)
                axpy_bf16(acc + (int64_t)g * head_dim, w, (const bf16_t *)v_cache + off, head_dim);
            else
                axpy_fp8(acc + (int64_t)g * head_dim, w, (const uint8_t *)v_cache + off, head_dim);
        }
    }
    write_heads(elem, out_row, acc, inv_sum, kv_head, group, head_dim);
}

/* ---- The vector path: head_dim a multiple of 16, G in {1, 2, 4, 8} -------------------------------------
 * The same three passes over vectors of VL floats (one register: 16 on AVX-512, 8 on AVX2): pass 1
 * feeds each loaded key vector to the G query heads' accumulators (two chains each where registers
 * allow, so the adds do not wait on each other); pass 2 takes the exps 16 keys at a time; pass 3
 * keeps G x C value accumulators in registers over a tile of TILE_KEYS keys (its rows stay in L1
 * between the C-vector chunks: C = value_chunk(G), the rest of a row one vector at a time). */
#include "paged_attention_vectors.h"

static inline __attribute__((always_inline)) void attend_vector(
        const int elem, const int CE, const int G, const void *q_row, int64_t q_stride_h, const void *k_cache,
        const void *v_cache, int64_t s_block, int64_t s_slot, int64_t s_head, void *out_row, const int32_t *blocks,
        int kv_head, int head_dim, int block_size, int first_key, int last_key, float scale, float *scores,
        float *qf, float *acc, int prefetch) {
    const int values_ahead = prefetch == PREFETCH_ROWS_AND_VALUES;
    const int n_keys = last_key - first_key + 1, nb = head_dim / VL, C = value_chunk(G);
    const int chains = 4 * G <= VECTOR_REGISTERS ? 2 : 1;
    /* a bf16 cache in load_pair's pairs (C and the two chains even: VECTOR_REGISTERS 32, G <= 8) */
    const int paired = PAIRED_BF16 && CE == 2 && head_dim % (2 * VL) == 0 && chains == 2 && C % 2 == 0;
    /* the cache's rows come divided by unit (load_unit_row): the scores' scale and the values' sums
     * take it back (a power of two: exactly, but for products below fp32's normal range) */
    const float unit = row_unit(CE);
    scale *= unit;
    for (int g = 0; g < G; g++) {
        const int h = kv_head * G + g;
        for (int b = 0; b < nb; b++) {
            const vecw v = load_row(q_row, h * q_stride_h + VL * b, elem);
            memcpy(qf + (int64_t)g * head_dim + VL * b, &v, sizeof v);
        }
#if PAIRED_BF16
        for (int b = 0; paired && b < nb; b += 2) { /* the query in the pairs' order */
            float *row = qf + (int64_t)g * head_dim + VL * b;
            vecw a, c, lo, hi;
            memcpy(&a, row, sizeof a);
            memcpy(&c, row + VL, sizeof c);
            pair_order(a, c, &lo, &hi);
            memcpy(row, &lo, sizeof lo);
            memcpy(row + VL, &hi, sizeof hi);
        }
#endif
    }
    /* pass 1: scores (and with values_ahead the value rows' prefetch: pass 3 then reads them from
     * L2 instead of waiting on memory a tile at a time) */
    for (int j = 0; j < n_keys; j++) {
        const int pos = first_key + j;
        const int64_t off = key_offset(blocks, pos, block_size, s_block, s_slot, s_head, kv_head);
        if (values_ahead && j < PREFETCH_KEYS) prefetch_row(v_cache, off, CE, head_dim); /* the first keys' */
        if (prefetch != PREFETCH_NONE && j + PREFETCH_KEYS < n_keys) {
            const int64_t ahead = key_offset(blocks, pos + PREFETCH_KEYS, block_size, s_block, s_slot, s_head, kv_head);
            prefetch_row(k_cache, ahead, CE, head_dim);
            if (values_ahead) prefetch_row(v_cache, ahead, CE, head_dim);
        }
        vecw even[MAX_GROUP], odd[MAX_GROUP]; /* two chains a head: even and odd vectors of the row */
        for (int g = 0; g < G; g++) even[g] = odd[g] = (vecw){0};
        int b = 0;
        for (; chains == 2 && b + 1 < nb; b += 2) {
            vecw k0, k1;
#if PAIRED_BF16
            if (paired)
                load_pair(k_cache, off + VL * b, &k0, &k1);
            else
#endif
                k0 = load_unit_row(k_cache, off + VL * b, CE), k1 = load_unit_row(k_cache, off + VL * b + VL, CE);
            for (int g = 0; g < G; g++) {
                vecw q0, q1;
                memcpy(&q0, qf + (int64_t)g * head_dim + VL * b, sizeof q0);
                memcpy(&q1, qf + (int64_t)g * head_dim + VL * b + VL, sizeof q1);
                even[g] += q0 * k0;
                odd[g] += q1 * k1;
            }
        }
        for (; b < nb; b++) {
            const vecw k0 = load_unit_row(k_cache, off + VL * b, CE);
            for (int g = 0; g < G; g++) {
                vecw q0;
                memcpy(&q0, qf + (int64_t)g * head_dim + VL * b, sizeof q0);
                even[g] += q0 * k0;
            }
        }
        for (int g = 0; g < G; g++) scores[(int64_t)g * n_keys + j] = sum_lanes(even[g] + odd[g]) * scale;
    }
    /* pass 2: softmax weights */
    float inv_sum[MAX_GROUP];
    for (int g = 0; g < G; g++) inv_sum[g] = softmax_weights(scores + (int64_t)g * n_keys, n_keys) * unit;
    /* pass 3: weighted values */
    memset(acc, 0, sizeof(float) * G * head_dim);
    for (int j0 = 0; j0 < n_keys; j0 += TILE_KEYS) {
        const int tile = n_keys - j0 < TILE_KEYS ? n_keys - j0 : TILE_KEYS;
        int64_t off[TILE_KEYS];
        for (int t = 0; t < tile; t++) {
            off[t] = key_offset(blocks, first_key + j0 + t, block_size, s_block, s_slot, s_head, kv_head);
            if (prefetch != PREFETCH_NONE && j0 + t + TILE_KEYS < n_keys)
                prefetch_row(v_cache, key_offset(blocks, first_key + j0 + t + TILE_KEYS, block_size, s_block, s_slot,
                                                 s_head, kv_head), CE, head_dim);
        }
        const float *weights = scores + j0;
        int b = 0;
        for (; b + C <= nb; b += C)
            weigh_values(CE, paired, G, C, v_cache, off, VL * b, tile, weights, n_keys, acc, head_dim);
        for (; paired && b < nb; b += 2) /* nb and C even: the rest in pairs */
            weigh_values(CE, paired, G, 2, v_cache, off, VL * b, tile, weights, n_keys, acc, head_dim);
        for (; b < nb; b++) weigh_values(CE, 0, G, 1, v_cache, off, VL * b, tile, weights, n_keys, acc, head_dim);
    }
#if PAIRED_BF16
    for (int g = 0; paired && g < G; g++)
        for (int b = 0; b < nb; b += 2) natural_order(acc + (int64_t)g * head_dim + VL * b);
#endif
    write_heads(elem, out_row, acc, inv_sum, kv_head, G, head_dim);
}

#include "paged_attention_tiles.h"

typedef void (*attend_fn)(const void *, int64_t, const void *, const void *, int64_t, int64_t, int64_t, void *,
                          const int32_t *, int, int, int, int, int, float, float *, float *, float *, int);

/* attend_<elem>_<cache elem>_<group> */
#define DEFINE_ATTEND(ELEM, CE, G)                                                                              \
    static void attend_##ELEM##_##CE##_##G(const void *q_row, int64_t q_stride_h, const void *k_cache,           \
                                           const void *v_cache, int64_t s_block, int64_t s_slot, int64_t s_head, \
                                           void *out_row, const int32_t *blocks, int kv_head, int head_dim,       \
                                           int block_size, int first_key, int last_key, float scale,             \
                                           float *scores, float *qf, float *acc, int prefetch) {                 \
        attend_vector(ELEM, CE, G, q_row, q_stride_h, k_cache, v_cache, s_block, s_slot, s_head, out_row,        \
                      blocks, kv_head, head_dim, block_size, first_key, last_key, scale, scores, qf, acc,        \
                      prefetch);                                                                               \
    }
#define DEFINE_GROUPS(ELEM, CE) \
    DEFINE_ATTEND(ELEM, CE, 1) DEFINE_ATTEND(ELEM, CE, 2) DEFINE_ATTEND(ELEM, CE, 4) DEFINE_ATTEND(ELEM, CE, 8)
DEFINE_GROUPS(4, 4) DEFINE_GROUPS(4, 2) DEFINE_GROUPS(4, 1) DEFINE_GROUPS(2, 2) DEFINE_GROUPS(2, 4) DEFINE_GROUPS(2, 1)

static int valid_elem(int elem) { return elem == 4 || elem == 2; }
static int valid_cache_elem(int cache_elem) { return cache_elem == 4 || cache_elem == 2 || cache_elem == 1; }

/* The vector path for this (elem, cache_elem, group, head_dim), or NULL (the scalar attend_one then). */
static attend_fn vector_path(int elem, int cache_elem, int group, int head_dim) {
    const int g = group == 1 ? 0 : group == 2 ? 1 : group == 4 ? 2 : group == 8 ? 3 : -1;
    if (g < 0 || head_dim % 16 != 0 || !valid_elem(elem) || !valid_cache_elem(cache_elem)) return NULL;
    static const attend_fn paths[2][3][4] = { /* [q fp32][cache fp8, bf16, fp32][group] */
        {{attend_2_1_1, attend_2_1_2, attend_2_1_4, attend_2_1_8},
         {attend_2_2_1, attend_2_2_2, attend_2_2_4, attend_2_2_8},
         {attend_2_4_1, attend_2_4_2, attend_2_4_4, attend_2_4_8}},
        {{attend_4_1_1, attend_4_1_2, attend_4_1_4, attend_4_1_8},
         {attend_4_2_1, attend_4_2_2, attend_4_2_4, attend_4_2_8},
         {attend_4_4_1, attend_4_4_2, attend_4_4_4, attend_4_4_8}}};
    return paths[elem == 4][cache_elem == 4 ? 2 : cache_elem == 2 ? 1 : 0][g];
}

/* 1 where (elem, cache_elem, group, head_dim) takes the vector path (the caller then gives it fresh
 * prompts too: on an AVX-512 Zen 5, a 272-token prompt of Gemma 3 270M's layout 1.5x faster than
 * torch's fused attention, a 64-token one 7x), else 0. */
int paged_attention_vector_path(int elem, int cache_elem, int group, int head_dim) {
    return vector_path(elem, cache_elem, group, head_dim) != NULL;
}

static int tiles_allowed = 1;

/* Whether prompt chunks take the tiles from now on in this process (tests compare the two paths);
 * returns the new tokens a chunk needs to take them (and *min_keys the keys it must see). */
int paged_attention_tiles(int allow, int *min_keys) {
    tiles_allowed = allow != 0;
    *min_keys = TILE_MIN_KEYS;
    return TILE_MIN_TOKENS;
}

/* Returns 0; -1 when a scratch allocation fails or the GQA group is too large; -2 for an element
 * size other than 4 or 2 (q, out) or 4, 2 or 1 (the cache). */
int paged_attention(int elem, int cache_elem, const void *q, int64_t q_stride_t, int64_t q_stride_h,
                    const void *k_cache, const void *v_cache, int64_t s_block, int64_t s_slot, int64_t s_head,
                    void *out, const int32_t *table, int64_t table_stride, const int32_t *query_start,
                    const int32_t *context_lens, int num_requests, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int window, float scale, int max_context, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || group < 1) return -1;
    if (!valid_elem(elem) || !valid_cache_elem(cache_elem)) return -2;
    const int num_tokens = query_start[num_requests];
    const int64_t items = (int64_t)num_tokens * num_kv_heads;
    const attend_fn vector = vector_path(elem, cache_elem, group, head_dim);
    /* prompt chunks that take the tiles (paged_attention_tiles.h): their keys' first position, the
     * transposed keys' stride and offset (each KV head's head_dim x stride floats), their units */
    const int tokens_a_unit = TILE_ROWS / group;
    int *key_first = calloc((size_t)num_requests + 1, sizeof(int));
    int *stride = calloc((size_t)num_requests + 1, sizeof(int));
    int64_t *kt_at = calloc((size_t)num_requests + 1, sizeof(int64_t));
    int64_t *unit_start = calloc((size_t)num_requests + 1, sizeof(int64_t));
    int64_t *voff_at = calloc((size_t)num_requests + 1, sizeof(int64_t)); /* each chunk's value rows' */
    if (!key_first || !stride || !kt_at || !unit_start || !voff_at) {
        free(key_first), free(stride), free(kt_at), free(unit_start), free(voff_at);
        return -1;
    }
    int max_stride = 0;
    for (int r = 0; r < num_requests; r++) {
        const int n_new = query_start[r + 1] - query_start[r], pos0 = context_lens[r] - n_new;
        const int first = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        const int n_keys = context_lens[r] - first;
        const int tiled = tiles_allowed && vector && n_new >= TILE_MIN_TOKENS && /* vector: G in 1-8 */
                          n_keys >= TILE_MIN_KEYS && n_keys <= TILE_MAX_KEYS;
        key_first[r] = first;
        stride[r] = tiled ? (n_keys + TILE_KEY_STEP - 1) / TILE_KEY_STEP * TILE_KEY_STEP : 0;
        max_stride = stride[r] > max_stride ? stride[r] : max_stride;
        kt_at[r + 1] = kt_at[r] + (int64_t)num_kv_heads * head_dim * stride[r];
        voff_at[r + 1] = voff_at[r] + stride[r];
        const int64_t units = (int64_t)num_kv_heads * ((n_new + tokens_a_unit - 1) / tokens_a_unit);
        unit_start[r + 1] = unit_start[r] + (tiled ? units : 0);
    }
    /* the tiled chunks' keys transposed and, from a bf16 or fp8 cache, their value rows widened (each KV
     * head's at kt_at in both); where each chunk's value rows are (voff) */
    float *kt = unit_start[num_requests] ? malloc(sizeof(float) * (size_t)kt_at[num_requests]) : NULL;
    float *vc = kt && cache_elem != 4 ? malloc(sizeof(float) * (size_t)kt_at[num_requests]) : NULL;
    int64_t *voff = kt ? malloc(sizeof(int64_t) * (size_t)voff_at[num_requests]) : NULL;
    if (unit_start[num_requests] && (!kt || !voff || (cache_elem != 4 && !vc))) {
        free(key_first), free(stride), free(kt_at), free(unit_start), free(voff_at), free(kt), free(vc), free(voff);
        return -1;
    }
    const tile_call call = {q,         q_stride_t, q_stride_h, out,    elem, cache_elem,
                            num_heads, head_dim,   group,      window, scale};
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
#endif
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_context > 0 ? max_context : 1));
        float *qf = malloc(sizeof(float) * (size_t)group * head_dim);
        float *acc = malloc(sizeof(float) * (size_t)group * head_dim);
        float *tile_scratch = kt ? malloc(sizeof(float) * (size_t)TILE_ROWS * (2 * head_dim + max_stride)) : NULL;
        int ok = scores && qf && acc && (!kt || tile_scratch);
        if (!ok) failed = 1;
        /* the tiled chunks' keys and values gathered (each thread whole (request, KV head) pairs); a
         * step without tiles (kt NULL, the same for every thread) skips this loop, the tiles' and
         * their barriers */
        if (kt) {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t pair = 0; pair < (int64_t)num_requests * num_kv_heads; pair++) {
                const int rr = (int)(pair / num_kv_heads), h = (int)(pair % num_kv_heads);
                if (!stride[rr]) continue;
                const int64_t at = kt_at[rr] + (int64_t)h * head_dim * stride[rr];
                gather_keys(k_cache, v_cache, cache_elem, s_block, s_slot, s_head, table + (int64_t)rr * table_stride,
                            block_size, h, key_first[rr], context_lens[rr] - key_first[rr], head_dim, kt + at,
                            stride[rr], vc ? vc + at : NULL, h == 0 ? voff + voff_at[rr] : NULL);
            }
        }
        int r = 0;
        /* A step of decodes alone deals its items one at a time: a few long items, whose keys differ in
         * number, over two threads (8 decodes of 100-380 keys, Gemma 3 270M's layout, 18 layers' caches
         * from memory: 2.2-4.7% faster than in fours, three interleaved runs); a prompt's tokens in
         * fours, which read the same keys. */
        const int items_a_take = num_tokens == num_requests ? 1 : 4;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, items_a_take) nowait
#endif
        for (int64_t item = 0; item < items; item++) {
            if (ok) {
                int t = (int)(item / num_kv_heads), kv_head = (int)(item % num_kv_heads);
                /* the request of token t (items come in order within a thread's chunk) */
                if (r >= num_requests || t < query_start[r] || t >= query_start[r + 1]) {
                    int lo = 0, hi = num_requests - 1;
                    while (lo < hi) {
                        int mid = (lo + hi + 1) / 2;
                        if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
                    }
                    r = lo;
                }
                if (stride[r]) continue; /* a tiled chunk's token */
                int n_new = query_start[r + 1] - query_start[r];
                int pos = context_lens[r] - n_new + (t - query_start[r]);
                int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                int64_t row = (int64_t)t * q_stride_t;
                int64_t out_row = (int64_t)t * num_heads * head_dim;
                const char *q_ptr = (const char *)q + row * elem;
                char *o_ptr = (char *)out + out_row * elem;
                /* a decode's rows are read by this item alone; a prompt's by its next tokens too (cached) */
                const int fits = (int64_t)(pos - first + 1) * head_dim * cache_elem <= VALUES_AHEAD_MAX_BYTES;
                const int prefetch = n_new == 1 ? (fits ? PREFETCH_ROWS_AND_VALUES : PREFETCH_ROWS)
                                                : (fits ? PREFETCH_NONE : PREFETCH_ROWS);
                if (vector)
                    vector(q_ptr, q_stride_h, k_cache, v_cache, s_block, s_slot, s_head, o_ptr,
                           table + (int64_t)r * table_stride, kv_head, head_dim, block_size, first, pos, scale,
                           scores, qf, acc, prefetch);
                else
                    attend_one(elem, cache_elem, q_ptr, q_stride_h, k_cache, v_cache, s_block, s_slot, s_head, o_ptr,
                               table + (int64_t)r * table_stride, kv_head, group, head_dim, block_size, first, pos,
                               scale, scores, qf, acc);
            }
        }
        if (kt) {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t unit = 0; unit < unit_start[num_requests]; unit++) {
                if (!ok) continue;
                int lo = 0, hi = num_requests - 1; /* the request: the last whose units start at or before */
                while (lo < hi) {
                    int mid = (lo + hi + 1) / 2;
                    if (unit_start[mid] <= unit) lo = mid; else hi = mid - 1;
                }
                const int rr = lo, n_new = query_start[rr + 1] - query_start[rr];
                const int64_t k = unit - unit_start[rr];
                const int h = (int)(k % num_kv_heads), tq0 = (int)(k / num_kv_heads) * tokens_a_unit;
                const int nt = n_new - tq0 < tokens_a_unit ? n_new - tq0 : tokens_a_unit;
                const int64_t at = kt_at[rr] + (int64_t)h * head_dim * stride[rr];
                const float *values = vc ? vc + at : (const float *)v_cache + (int64_t)h * s_head;
                attend_tile(&call, h, key_first[rr], kt + at, values, voff + voff_at[rr], stride[rr], query_start[rr],
                            context_lens[rr] - n_new, tq0, nt,
                            tile_scratch, tile_scratch + (int64_t)TILE_ROWS * head_dim,
                            tile_scratch + (int64_t)TILE_ROWS * (head_dim + max_stride));
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(tile_scratch);
    }
    free(key_first), free(stride), free(kt_at), free(unit_start), free(voff_at), free(kt), free(vc), free(voff);
    return failed ? -1 : 0;
}
