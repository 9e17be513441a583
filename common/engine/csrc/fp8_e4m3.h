/* float8 e4m3 ("fn": no infinities, 0x7F / 0xFF the NaNs, +-448 the largest), the KV cache's
 * `--kv-cache-dtype fp8` values, with no scale (as vLLM's fp8 cache without calibrated scales):
 * value = (-1)^s 2^(e - 7) (1 + m / 8) for e in 1..15, (-1)^s 2^-6 (m / 8) for e = 0.
 *
 * fp8_e4m3_from_f32 rounds as torch's float32 -> float8_e4m3fn conversion does, bit for bit:
 * to nearest even, anything from 448 up (infinities too) saturated to +-448, a NaN to 0x7F with its
 * sign.  fp8_e4m3_to_f32 (a table) widens exactly, a NaN to NaN, as paged_attention_vectors.h's
 * load_fp8_row does VL values at a time (tests: tests/engine/test_fp8_kv_cache.py). */
#ifndef PDSERVE_FP8_E4M3_H
#define PDSERVE_FP8_E4M3_H
#include <stdint.h>
#include <string.h>

#define FP8_E4M3_MAX_BITS 0x43E00000u      /* 448.0f */
#define FP8_E4M3_MIN_NORMAL_BITS 0x3C800000u /* 2^-6 */
#define FP8_SUBNORMAL_ROUNDER 16384.0f       /* 2^14: a sum with it has an ulp of 2^-9, e4m3's subnormal step */
#define FP8_SUBNORMAL_ROUNDER_BITS 0x46800000u
#define FP8_EXPONENT_BIAS_GAP (120u << 3)    /* (127 - 7) in the exponent's place of (fp32 bits >> 20) */

static inline uint8_t fp8_e4m3_from_f32(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7FFFFFFFu;
    uint32_t code;
    if (magnitude > 0x7F800000u) {
        code = 0x7F;
    } else if (magnitude >= FP8_E4M3_MAX_BITS) {
        code = 0x7E;
    } else if (magnitude < FP8_E4M3_MIN_NORMAL_BITS) { /* a multiple of 2^-9, rounded by the fp32 sum */
        float a, sum;
        memcpy(&a, &magnitude, sizeof a);
        sum = a + FP8_SUBNORMAL_ROUNDER;
        uint32_t sum_bits;
        memcpy(&sum_bits, &sum, sizeof sum_bits);
        code = sum_bits - FP8_SUBNORMAL_ROUNDER_BITS; /* 0..8 (8: the smallest normal) */
    } else { /* 3 of the 23 mantissa bits kept, to nearest even; a carry moves the exponent */
        code = ((magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20) - FP8_EXPONENT_BIAS_GAP;
    }
    return (uint8_t)(sign | code);
}

/* Every code's value, filled when the library loads. */
static float fp8_e4m3_values[256];

__attribute__((constructor)) static void fp8_e4m3_fill_values(void) {
    for (int x = 0; x < 256; x++) {
        const int e = (x >> 3) & 15, m = x & 7;
        float v = e ? (1.0f + m / 8.0f) : m / 8.0f;
        for (int i = 7; i > (e ? e : 1); i--) v *= 0.5f; /* 2^(e - 7), 2^-6 for e = 0 */
        for (int i = 7; i < e; i++) v *= 2.0f;
        if ((x & 0x7F) == 0x7F) v = __builtin_nanf("");
        fp8_e4m3_values[x] = x & 0x80 ? -v : v;
    }
}

static inline float fp8_e4m3_to_f32(uint8_t x) { return fp8_e4m3_values[x]; }

#endif
