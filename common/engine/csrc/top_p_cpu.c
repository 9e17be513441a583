/*
 * Top-p (nucleus) sampling over rows of unnormalised probabilities, without sorting a row.
 *
 * Input: e[rows, vocab] (row stride in elements), fp32, every value in [0, 1] (the sampler's
 * exp(logit / T - row max): the row's largest value is exactly 1), top_p[rows] in (0, 1],
 * u[rows] uniform in [0, 1).  Output: out[rows], the sampled column of each row.
 *
 * The nucleus is the sorted rule: a token is kept when the mass strictly above it (in descending
 * order) is below top_p * total.  Values in [0, 1] order as their float bit patterns, so the top
 * 16 bits (sign, exponent, 7 mantissa bits) bucket a row monotonically:
 *   pass 1: each bucket's mass (fp64)      -> the boundary bucket, where the kept mass crosses
 *   pass 2: the boundary bucket's values, sorted descending -> the smallest kept value (threshold)
 *   pass 3: inverse CDF over the kept tokens in column order
 * Tokens tied with the threshold are kept in column order, as many as the sorted rule keeps (a
 * stable sort orders ties by column).  One row is one thread's work (OpenMP over rows).
 *
 * Returns 0, or -1 when scratch memory could not be allocated.
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BUCKETS ((0x3F800000u >> 16) + 1) /* keys of every value in [0, 1] */

static inline uint32_t key_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    uint32_t key = bits >> 16;
    return key < BUCKETS ? key : 0; /* negative or NaN (never produced): the lowest bucket */
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static int64_t sample_row(const float *x, int64_t vocab, double top_p, double u, double *mass, float *vals) {
    /* two interleaved histograms: consecutive values of a flat row share a bucket, and one
       histogram would serialise on that bucket's read-modify-write */
    double *mass_odd = mass + BUCKETS;
    memset(mass, 0, 2 * BUCKETS * sizeof(double));
    int64_t j = 0;
    for (; j + 1 < vocab; j += 2) {
        mass[key_of(x[j])] += (double)x[j];
        mass_odd[key_of(x[j + 1])] += (double)x[j + 1];
    }
    if (j < vocab) mass[key_of(x[j])] += (double)x[j];
    for (int64_t b = 0; b < BUCKETS; b++) mass[b] += mass_odd[b];
    /* inclusive[b]: mass at or above bucket b; the boundary is the highest b where it reaches target */
    double total = 0.0;
    for (int64_t b = BUCKETS - 1; b >= 0; b--) total += mass[b];
    double target = top_p * total, inclusive = 0.0, above = 0.0;
    int64_t boundary = 0;
    for (int64_t b = BUCKETS - 1; b >= 0; b--) {
        inclusive += mass[b];
        if (inclusive >= target) {
            boundary = b;
            above = inclusive - mass[b];
            break;
        }
    }
    int64_t n = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (key_of(x[j]) == (uint32_t)boundary) vals[n++] = x[j];
    /* the kept prefix of the boundary bucket in descending order; ties with its smallest value
       are kept in column order up to the prefix's count of them, as a stable sort would */
    qsort(vals, (size_t)n, sizeof(float), descending);
    double before = 0.0;
    int64_t kept_n = 0;
    while (kept_n < n && above + before < target) before += (double)vals[kept_n++];
    if (kept_n == 0) kept_n = n > 0 ? 1 : 0; /* unreachable: the bucket's largest is always kept */
    float threshold = kept_n > 0 ? vals[kept_n - 1] : 0.0f;
    int64_t ties_kept = 0;
    for (int64_t i = kept_n - 1; i >= 0 && vals[i] == threshold; i--) ties_kept++;
    double kept = above + before;
    /* pass 3: the first kept column where the running kept mass passes u * kept */
    double goal = u * kept, running = 0.0;
    int64_t last = 0, ties = 0;
    for (int64_t j = 0; j < vocab; j++) {
        float v = x[j];
        if (v > threshold || (v == threshold && ties++ < ties_kept)) {
            running += (double)v;
            last = j;
            if (running > goal) return j;
        }
    }
    return last; /* rounding left the goal unreached: the last kept column */
}

int top_p_sample(const float *e, int64_t rows, int64_t vocab, int64_t row_stride, const float *top_p,
                 const double *u, int64_t *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
    {
        double *mass = (double *)malloc(2 * BUCKETS * sizeof(double));
        float *vals = (float *)malloc((size_t)vocab * sizeof(float));
        int ok = mass != NULL && vals != NULL;
        if (!ok) failed = 1;
        /* every thread reaches the worksharing loop, even one whose scratch failed */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++)
            out[r] = ok ? sample_row(e + r * row_stride, vocab, (double)top_p[r], u[r], mass, vals) : 0;
        free(mass);
        free(vals);
    }
    return failed ? -1 : 0;
}
