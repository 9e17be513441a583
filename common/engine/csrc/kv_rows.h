/* One row of the paged KV cache written from fp32 values, in the cache's dtype (fused_layers_cpu.c's
 * and kv_write_cpu.c's writes of the new tokens' keys and values). */
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
#endif
