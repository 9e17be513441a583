/* The new tokens' keys and values written from fp32 values into the paged KV cache, in the cache's
 * dtype (fused_layers_cpu.c's and kv_write_cpu.c's writes). */
#ifndef PDSERVE_KV_ROWS_H
#define PDSERVE_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#include "fp8_e4m3.h"

/* n values of src into a cache row of elem bytes a value: a bf16 cache takes them rounded to nearest
 * even, any NaN as 0xFFFF -- as torch's fp32 -> bf16 tensor conversion does (its vector kernel; the
 * scalar c10::BFloat16 gives 0x7FC0) --, an fp8 one as torch's fp32 -> float8_e4m3fn conversion does
 * (fp8_e4m3.h). */
static inline void store_row(void *dst, const float *src, int64_t n, int elem) {
    if (elem == 4) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    if (elem == 1) {
        for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = fp8_e4m3_from_f32(src[i]);
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, src + i, sizeof bits);
        out[i] = src[i] != src[i] ? (uint16_t)0xFFFF : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

/* Row r's KV head g from k + r * s_k + g * head_dim (v alike) into slot (slot_blocks[r],
 * slot_offsets[r]) of the caches [blocks, block_size, kv_heads, head_dim] at strides s_block, s_slot,
 * s_head (values; a head's values contiguous), cache_elem bytes a value.  Returns 0, or -2 where a
 * slot lies outside [0, num_blocks) x [0, block_size) (nothing written then). */
static inline int store_kv_rows(void *key_cache, void *value_cache, int cache_elem, int64_t num_blocks,
                                int64_t block_size, int64_t s_block, int64_t s_slot, int64_t s_head,
                                const int64_t *slot_blocks, const int64_t *slot_offsets, const float *k, int64_t s_k,
                                const float *v, int64_t s_v, int64_t rows, int64_t kv_heads, int64_t head_dim) {
    for (int64_t r = 0; r < rows; r++)
        if (slot_blocks[r] < 0 || slot_blocks[r] >= num_blocks || slot_offsets[r] < 0 || slot_offsets[r] >= block_size)
            return -2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t slot = slot_blocks[r] * s_block + slot_offsets[r] * s_slot;
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = (slot + g * s_head) * cache_elem;
            store_row((char *)key_cache + at, k + r * s_k + g * head_dim, head_dim, cache_elem);
            store_row((char *)value_cache + at, v + r * s_v + g * head_dim, head_dim, cache_elem);
        }
    }
    return 0;
}
#endif
