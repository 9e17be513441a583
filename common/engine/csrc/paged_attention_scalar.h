/* The scalar path's row products for paged_attention_cpu.c (its only includer, after bf16_t and
 * bf16_to_f32): a query row against a cache row of fp32, bf16 or fp8 e4m3 values (dot_*), a weighted
 * cache row added to an accumulator (axpy_*).  Taken where the vector path is not (a GQA group
 * outside 1, 2, 4, 8 or a head_dim not a multiple of 16). */
#ifndef PAGED_ATTENTION_SCALAR_H
#define PAGED_ATTENTION_SCALAR_H
#include <math.h>
#include <stdint.h>

#include "fp8_e4m3.h"

static inline float f32_value(float x) { return x; }

/* dot_<NAME>(a, b, n): 32 lanes, four independent vector chains, so the FMA latency does not
 * serialize the sum; axpy_<NAME>(y, a, x, n): y += a x.  WIDEN: a cached value (TYPE) as a float.
 * Every product-sum is an explicit fmaf: left to -ffp-contract, GCC contracted the fp32 and fp8
 * variants apart on a Xeon with AVX512-FP16 (the same values summed apart in their last bits). */
#define DEFINE_ROW_PRODUCTS(NAME, TYPE, WIDEN)                                                            \
    static inline float dot_##NAME(const float *a, const TYPE *b, int n) {                               \
        float acc[32] = {0};                                                                              \
        int i = 0;                                                                                        \
        for (; i + 32 <= n; i += 32)                                                                      \
            for (int l = 0; l < 32; l++) acc[l] = fmaf(a[i + l], WIDEN(b[i + l]), acc[l]);                \
        for (int l = 0; l < 8; l++) acc[l] = (acc[l] + acc[l + 16]) + (acc[l + 8] + acc[l + 24]);         \
        float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));      \
        for (; i < n; i++) s = fmaf(a[i], WIDEN(b[i]), s);                                                \
        return s;                                                                                         \
    }                                                                                                     \
    static inline void axpy_##NAME(float *y, float a, const TYPE *x, int n) {                            \
        for (int i = 0; i < n; i++) y[i] = fmaf(a, WIDEN(x[i]), y[i]);                                    \
    }
DEFINE_ROW_PRODUCTS(f32, float, f32_value)
DEFINE_ROW_PRODUCTS(bf16, bf16_t, bf16_to_f32)
DEFINE_ROW_PRODUCTS(fp8, uint8_t, fp8_e4m3_to_f32)

#endif
