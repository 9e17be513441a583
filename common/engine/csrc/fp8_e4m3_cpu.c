/* fp8_e4m3.h's conversions as entries: tests hold them to torch's float32 <-> float8_e4m3fn
 * conversions bit for bit (the fused layers store the KV cache's fp8 rows with the same function).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes. */
#include <stdint.h>

#include "fp8_e4m3.h"

void fp8_e4m3_encode(const float *src, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp8_e4m3_from_f32(src[i]);
}

void fp8_e4m3_decode(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp8_e4m3_to_f32(src[i]);
}
