/* A gated MLP's activation, out = act(gate) * up, in one pass over fp32 rows.
 *
 * Eagerly, torch computes it as two ops over the fused gate/up product's output (the activation,
 * then the product with up), ~40 us of a decode step's 8 x 2048 values on a 2-core machine, most of
 * it dispatch and a tanh per value: here one call of a few microseconds.  Row r's gate is
 * gu[r * s_row + i] and its up gu[r * s_row + width + i] (i < width: the halves of a fused gate/up
 * row, as ``chunk(2)`` splits it); out is contiguous [rows, width].
 *
 *   ACT_SILU       silu(g) = g * sigmoid(g)
 *   ACT_GELU_TANH  gelu's tanh approximation, 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3),
 *                  computed as g * sigmoid(2u) (the same function: 0.5 (1 + tanh u) = sigmoid(2u))
 *
 * sigmoid(z) = 1 / (1 + e^-z) for z >= 0 and e^z / (1 + e^z) below, so the exponential's argument
 * is never positive (vec16.h's exp_nonpositive, 2^-21 relative): within a few units of the last
 * place of torch's values (which take a vectorized tanh or exp; the tests bound the difference).
 * Rows are split among OpenMP threads only when there are many (a prefill run eagerly).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define PARALLEL_MIN (1 << 13) /* values in a call before rows are split among threads */

static inline __attribute__((always_inline)) vec16 sigmoid(vec16 z) {
    const ivec16 negative = z < 0.0f;
    const vec16 magnitude = (vec16)((ivec16)z & ((ivec16){0} + 0x7fffffff)); /* |z|: the sign bit off */
    const vec16 e = exp_nonpositive((vec16){0} - magnitude);
    const vec16 inverse = 1.0f / (1.0f + e);
    return (vec16)((negative & (ivec16)(e * inverse)) | (~negative & (ivec16)inverse));
}

static inline __attribute__((always_inline)) vec16 activate(vec16 g, int kind) {
    if (kind == ACT_SILU) return g * sigmoid(g);
    const vec16 u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g * sigmoid(u + u);
}

static void one_row(const float *gate, const float *up, int64_t width, int kind, float *out) {
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        vec16 g, u;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        const vec16 y = activate(g, kind) * u;
        memcpy(out + i, &y, sizeof y);
    }
    if (i < width) { /* the tail through a zero-padded vector */
        const size_t left = sizeof(float) * (size_t)(width - i);
        vec16 g = {0}, u = {0};
        memcpy(&g, gate + i, left);
        memcpy(&u, up + i, left);
        const vec16 y = activate(g, kind) * u;
        memcpy(out + i, &y, left);
    }
}

/* Returns 0, or -1 for an unknown kind or a width that is not positive. */
int gated_activation(const float *gu, int64_t rows, int64_t width, int64_t s_row, int kind, float *out,
                     int num_threads) {
    if (width <= 0 || (kind != ACT_SILU && kind != ACT_GELU_TANH)) return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) if (rows * width >= PARALLEL_MIN)
#endif
    for (int64_t r = 0; r < rows; r++) one_row(gu + r * s_row, gu + r * s_row + width, width, kind, out + r * width);
    return 0;
}
