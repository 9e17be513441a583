/* Generic 16-lane float vectors, shared by the kernels that include this header (GCC splits them
 * as the ISA needs; they are used inlined only, so no ABI is involved). */
#ifndef PDSERVE_VEC16_H
#define PDSERVE_VEC16_H
#include <stdint.h>

#pragma GCC diagnostic ignored "-Wpsabi"
typedef float vec16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t ivec16 __attribute__((vector_size(16 * sizeof(int32_t))));

/* e^v for lanes v <= 0, within 2^-21 relative (2.3e-7 the worst over every float in [-87, 0]) (v
 * below -87 counts as -87: e^-87 ~ 1.6e-38): v = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6
 * Taylor polynomial (remainder < 1.3e-7), 2^n from bits. */
static inline __attribute__((always_inline)) vec16 exp_nonpositive(vec16 v) {
    const ivec16 low = v < -87.0f;
    v = (vec16)((low & (ivec16)((vec16){0} - 87.0f)) | (~low & (ivec16)v));
    const vec16 shifted = v * 1.44269504088896341f + 12582912.0f; /* 0x1.8p23: rounds to an integer */
    const vec16 n = shifted - 12582912.0f;
    const vec16 r = (v - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f; /* ln2 in two parts */
    const vec16 poly = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    const ivec16 scale = (((ivec16)shifted - 0x4B400000) + 127) << 23;
    return poly * (vec16)scale;
}
#endif
