/* The new tokens' keys and values into their slots of a layer's paged KV cache: the CPU attention
 * backend's write (common/engine/attention/backend_cpu.py), one row copy -- or conversion to the
 * cache's dtype, rounded as torch rounds it (kv_rows.h) -- a token and KV head.
 *
 * Why: torch's indexed assignment of the [tokens, kv_heads, head_dim] rows took 0.5-0.7 ms a layer
 * for a 2048-token prefill chunk of Gemma 3 270M (two index_puts, ~3.7 GB/s), 20-25 ms of a ~700 ms
 * step on a 2-core Xeon; the cache holds the same bits either way (tests/engine/test_kv_write.py).
 *
 * k [rows, kv_heads, head_dim] at row stride s_k (values; each row's heads contiguous), v alike;
 * the rest as kv_rows.h's store_kv_rows (cache_elem 4 fp32, 2 bf16, 1 fp8 e4m3).  Returns 0, or -2
 * where a slot lies outside the cache (nothing written then).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes. */
#include <stdint.h>

#include "kv_rows.h"

int kv_write(void *key_cache, void *value_cache, int cache_elem, int64_t num_blocks, int64_t block_size,
             int64_t s_block, int64_t s_slot, int64_t s_head, const int64_t *slot_blocks, const int64_t *slot_offsets,
             const float *k, int64_t s_k, const float *v, int64_t s_v, int64_t rows, int64_t kv_heads,
             int64_t head_dim) {
    return store_kv_rows(key_cache, value_cache, cache_elem, num_blocks, block_size, s_block, s_slot, s_head,
                         slot_blocks, slot_offsets, k, s_k, v, s_v, rows, kv_heads, head_dim);
}
