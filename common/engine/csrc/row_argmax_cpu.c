/* Each row's maximum and the index of its first occurrence, as torch.max(x, dim=-1) gives them.
 *
 * torch's kernel compares values with their indices one by one: ~0.22 ms a 262k-wide row of logits
 * on one core, 1.8 ms for a 16-row decode step on two.  Here each of 16 lanes keeps its own best
 * (value, index), replaced only by a strictly greater value, so a lane keeps its first maximum; the
 * lanes then agree on the greatest value and, among equal ones, the smallest index: the row's first
 * maximum.  NaN is a row's maximum for torch (at its first NaN); a row holding one is found while
 * scanning and searched again for it.  Rows are split among OpenMP threads.
 *
 *   x       [rows, n] fp32, row stride ldx, n < 2^31
 *   values  [rows] fp32,  indices [rows] int64
 *
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static void one_row(const float *x, int64_t n, float *value, int64_t *index) {
    if (n < LANES) {
        float best = x[0];
        int64_t at = 0;
        for (int64_t i = 1; i < n; i++) {
            if (isnan(best)) break;
            if (x[i] > best || isnan(x[i])) best = x[i], at = i;
        }
        *value = best, *index = at;
        return;
    }
    /* GCC's vector extension: one 16-lane register of values, one of indices (32-bit, so both
     * fit the same mask), one poison accumulator */
    vf best, poison = {0}, v;
    vi at, idx, step;
    memcpy(&best, x, sizeof best);
    for (int l = 0; l < LANES; l++) at[l] = l, step[l] = LANES;
    idx = at;
    int64_t i = LANES;
    for (; i + LANES <= n; i += LANES) {
        memcpy(&v, x + i, sizeof v);
        idx += step;
        const vi greater = v > best; /* all ones where strictly greater */
        best = (vf)(((vi)v & greater) | ((vi)best & ~greater));
        at = (idx & greater) | (at & ~greater);
        poison += v * 0.0f; /* NaN once a NaN or an infinity passed: then look for a NaN */
    }
    int nan_seen = 0;
    for (int l = 0; l < LANES; l++) nan_seen |= poison[l] != poison[l] || best[l] != best[l];
    for (; i < n; i++) { /* the tail, into lane 0 (its index is past every lane's) */
        nan_seen |= x[i] != x[i];
        if (x[i] > best[0]) best[0] = x[i], at[0] = (int32_t)i;
    }
    if (nan_seen) {
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) {
                *value = x[j], *index = j;
                return;
            }
    }
    float top = best[0];
    int32_t top_at = at[0];
    for (int l = 1; l < LANES; l++)
        if (best[l] > top || (best[l] == top && at[l] < top_at)) top = best[l], top_at = at[l];
    *value = top, *index = top_at;
}

void row_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, float *values, int64_t *indices,
                int num_threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) if (rows > 1)
#endif
    for (int64_t r = 0; r < rows; r++) one_row(x + r * ldx, n, values + r, indices + r);
}
