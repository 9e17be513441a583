/* Paged attention on CPU that reads the KV cache in place through the block table.
 *
 * One call covers a whole packed step: prompt chunks and decodes of every request.  Work items
 * are (query token, KV head); each runs the GQA group of query heads that share that KV head
 * against the token's visible keys, read straight from the cache blocks (no gather), with a
 * two-pass softmax in fp32 (scores, then max / exp / sum, then the weighted sum of values).
 *
 *   q       [T, H, D]               packed new tokens, D contiguous
 *   cache   [num_blocks, block_size, KVH, D]   per-layer K (or V) view, any block/slot/head strides
 *   out     [T, H, D]               contiguous
 *   table   int32 [R, table_stride] each request's block ids
 *   query_start int32 [R + 1], context_lens int32 [R] (keys after this step, new ones included)
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

#define MAX_GROUP 16
/* Keys ahead whose rows are prefetched: a key's row is a few hundred cycles of work, a miss to
 * memory (the blocks are scattered, so the hardware prefetchers lose the stream at each block) about
 * as long: a few keys ahead keep the loads in flight.  Into L2 (locality 1), whose miss queue holds
 * more lines in flight than L1's fill buffers: 16 streams of 210 keys, 560 -> 470 us a layer. */
#define PREFETCH_KEYS 6
#define CACHE_LINE 64

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float dot_f32(const float *a, const float *b, int n) {
    /* 32 lanes: four independent vector chains, so the FMA latency does not serialize the sum */
    float acc[32] = {0};
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 32; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; l < 8; l++) acc[l] = (acc[l] + acc[l + 16]) + (acc[l + 8] + acc[l + 24]);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_bf16(const float *a, const bf16_t *b, int n) {
    /* 32 lanes: four independent vector chains, so the FMA latency does not serialize the sum */
    float acc[32] = {0};
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 32; l++) acc[l] += a[i + l] * bf16_to_f32(b[i + l]);
    for (int l = 0; l < 8; l++) acc[l] = (acc[l] + acc[l + 16]) + (acc[l + 8] + acc[l + 24]);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * bf16_to_f32(b[i]);
    return s;
}

static inline void axpy_f32(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static inline void axpy_bf16(float *y, float a, const bf16_t *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * bf16_to_f32(x[i]);
}

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

/* One (query token, KV head) item.  elem: 4 = fp32 cache, 2 = bf16 cache (q and out follow it). */
static void attend_one(int elem, const void *q_row, int64_t q_stride_h, const void *k_cache, const void *v_cache,
                       int64_t s_block, int64_t s_slot, int64_t s_head, void *out_row, const int32_t *blocks,
                       int kv_head, int group, int head_dim, int block_size, int first_key, int last_key,
                       float scale, float *scores, float *qf, float *acc) {
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
                         elem, head_dim);
        for (int g = 0; g < group; g++) {
            float s = elem == 4 ? dot_f32(qf + (int64_t)g * head_dim, (const float *)k_cache + off, head_dim)
                                : dot_bf16(qf + (int64_t)g * head_dim, (const bf16_t *)k_cache + off, head_dim);
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
                         elem, head_dim);
        for (int g = 0; g < group; g++) {
            float w = scores[(int64_t)g * n_keys + j];
            if (elem == 4)
                axpy_f32(acc + (int64_t)g * head_dim, w, (const float *)v_cache + off, head_dim);
            else
                axpy_bf16(acc + (int64_t)g * head_dim, w, (const bf16_t *)v_cache + off, head_dim);
        }
    }
    for (int g = 0; g < group; g++) {
        int h = kv_head * group + g;
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

/* Returns 0, or -1 when a scratch allocation fails or the GQA group is too large. */
int paged_attention(int elem, const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache,
                    const void *v_cache, int64_t s_block, int64_t s_slot, int64_t s_head, void *out,
                    const int32_t *table, int64_t table_stride, const int32_t *query_start,
                    const int32_t *context_lens, int num_requests, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int window, float scale, int max_context, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || group < 1) return -1;
    const int num_tokens = query_start[num_requests];
    const int64_t items = (int64_t)num_tokens * num_kv_heads;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
#endif
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_context > 0 ? max_context : 1));
        float *qf = malloc(sizeof(float) * (size_t)group * head_dim);
        float *acc = malloc(sizeof(float) * (size_t)group * head_dim);
        int ok = scores && qf && acc;
        if (!ok) failed = 1;
        int r = 0;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
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
                int n_new = query_start[r + 1] - query_start[r];
                int pos = context_lens[r] - n_new + (t - query_start[r]);
                int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                int64_t row = (int64_t)t * q_stride_t;
                int64_t out_row = (int64_t)t * num_heads * head_dim;
                const char *q_ptr = (const char *)q + row * elem;
                char *o_ptr = (char *)out + out_row * elem;
                attend_one(elem, q_ptr, q_stride_h, k_cache, v_cache, s_block, s_slot, s_head, o_ptr,
                           table + (int64_t)r * table_stride, kv_head, group, head_dim, block_size, first, pos,
                           scale, scores, qf, acc);
            }
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed ? -1 : 0;
}
