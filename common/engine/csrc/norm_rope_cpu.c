/* RMSNorm, and the residual add or rotary embedding that follows it, in one pass over fp32 rows.
 *
 * A decode step runs each of these as several small torch ops (RMSNorm: pow, mean, add, rsqrt, mul,
 * mul; RoPE: two slices, neg, cat, mul, mul, add), a few microseconds of dispatch each for a few
 * hundred floats of work: one call here replaces them.  For each row r of x (its `dim` values
 * contiguous; rows indexed in two levels, r = i * inner + j at x + i * s_outer + j * s_inner, so a
 * [tokens, heads, head_dim] view of a fused projection's output is read in place):
 *
 *   y = w * (x * (1 / sqrt(sum(x^2) / dim + eps)))  (y = x where w is NULL: RoPE alone)
 *   y = res[i] + y                                 where res is given (row i, stride s_res)
 *   y = y * cos[i] + rotate_half(y) * sin[i]       where cos is given (token i, stride s_cs),
 *                                                  rotate_half(y) = (-y[half:], y[:half])
 *   out[r] = y                                     (out contiguous [rows, dim])
 *
 * Each step rounds as the torch ops do (no contraction into fused multiply-adds: this file turns
 * it off); only the sum of squares is ordered differently (16 partial sums), so results equal
 * torch's to the last bit or two.  Rows are split among OpenMP threads only when there are many
 * (a prefill run eagerly); a decode step's few rows stay on the calling thread.
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARTIALS 16
#define PARALLEL_MIN (1 << 16) /* values in a call before rows are split among threads */

static float sum_of_squares(const float *x, int64_t dim) {
    float acc[PARTIALS] = {0};
    int64_t d = 0;
    for (; d + PARTIALS <= dim; d += PARTIALS)
        for (int l = 0; l < PARTIALS; l++) acc[l] += x[d + l] * x[d + l];
    float s = 0.0f;
    for (int l = 0; l < PARTIALS; l++) s += acc[l];
    for (; d < dim; d++) s += x[d] * x[d];
    return s;
}

static void one_row(const float *x, int64_t dim, const float *w, float eps, const float *res, const float *cos,
                    const float *sin, float *out) {
    if (w != NULL) {
        const float scale = 1.0f / sqrtf(sum_of_squares(x, dim) / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[d] = w[d] * (x[d] * scale);
    } else {
        memcpy(out, x, sizeof(float) * (size_t)dim);
    }
    if (res != NULL)
        for (int64_t d = 0; d < dim; d++) out[d] = res[d] + out[d];
    if (cos != NULL) { /* in place, a pair (d, d + half) at a time */
        const int64_t half = dim / 2;
        for (int64_t d = 0; d < half; d++) {
            const float a = out[d], b = out[d + half];
            out[d] = a * cos[d] + (-b) * sin[d];
            out[d + half] = b * cos[d + half] + a * sin[d + half];
        }
    }
}

/* Returns 0, or -1 where dim is not positive, or odd with a rotation. */
int rms_norm_rope(const float *x, int64_t rows, int64_t inner, int64_t s_outer, int64_t s_inner, int64_t dim,
                  const float *w, float eps, const float *res, int64_t s_res, const float *cos, const float *sin,
                  int64_t s_cs, float *out, int num_threads) {
    if (dim <= 0 || inner <= 0 || (cos != NULL && dim % 2 != 0)) return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) if (rows * dim >= PARALLEL_MIN)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / inner, j = r % inner;
        one_row(x + i * s_outer + j * s_inner, dim, w, eps, res != NULL ? res + i * s_res : NULL,
                cos != NULL ? cos + i * s_cs : NULL, cos != NULL ? sin + i * s_cs : NULL, out + r * dim);
    }
    return 0;
}
