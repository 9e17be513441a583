/* vnni_rows.h's counterpart on CPUs with AVX2 and FMA but no AVX512-VNNI (int4_vnni_cpu.c's second
 * build): the same activations' quantization -- per row and group of ``group`` inputs, symmetric,
 * xq = round(x * 127 / amax) (ties to even), scale amax / 127 -- and a driver that splits blocks of
 * 16 output channels among OpenMP threads (chunks of CHUNK blocks; within a chunk rows 4 at a time,
 * one block a pass: with 8-lane vectors a tile of 4 rows by 16 channels already holds every
 * register).  A tile writes its rows' 16 outputs (scaled by the tile) to out[i * LANES + c], copied
 * into y here.
 * Included only where __AVX2__ and __FMA__ without __AVX512VNNI__. */
#ifndef VNNI_ROWS_AVX2_H
#define VNNI_ROWS_AVX2_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vnni_shared.h"

#define ROWS 4   /* rows a pass over a block */

/* The 8 lanes' sum and largest value. */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* n <= 8 values at p as 8 lanes (the rest zero; ``part``: scratch for a partial load). */
static inline __m256 load8(const float *p, int64_t n, float *part) {
    if (n >= 8) return _mm256_loadu_ps(p);
    memset(part, 0, sizeof(float) * 8);
    memcpy(part, p, sizeof(float) * (size_t)n);
    return _mm256_loadu_ps(part);
}

/* Rows [rows, k_in] of x into xq [rows, k_pad] (int8, the pad zero), xs [rows, groups] (the groups'
 * scales), sums [rows, groups] (each group's sum of xq) and x_sums (each group's sum of x, fp32). */
static void quantize_rows(const float *x, int64_t rows, int64_t k_in, int64_t k_pad, int64_t group, int8_t *xq,
                          float *xs, int32_t *sums, float *x_sums) {
    int64_t groups = (k_pad + group - 1) / group;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
#pragma omp parallel for schedule(static) if (rows * k_pad >= PARALLEL_MIN)
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * k_in;
        int8_t *qm = xq + m * k_pad;
        memset(qm, 0, (size_t)k_pad);
        for (int64_t g = 0; g < groups; g++) {
            int64_t start = g * group, len = k_in - start < group ? k_in - start : group;
            float part[8];
            __m256 top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
            for (int64_t j = 0; j < len; j += 8) {
                __m256 v = load8(xm + start + j, len - j, part);
                top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));
                total = _mm256_add_ps(total, v);
            }
            float amax = len > 0 ? max8(top) : 0.0f;
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0, q[8];
            for (int64_t j = 0; j < len; j += 8) {
                int64_t n = len - j < 8 ? len - j : 8;
                __m256 v = _mm256_mul_ps(load8(xm + start + j, n, part), _mm256_set1_ps(inverse));
                _mm256_storeu_si256((__m256i *)q, _mm256_cvtps_epi32(v)); /* to nearest, ties to even */
                for (int64_t l = 0; l < n; l++) /* wrapping as vnni_rows.h's vector sum does (a NaN's q) */
                    qm[start + j + l] = (int8_t)q[l], sum = (int32_t)((uint32_t)sum + (uint32_t)q[l]);
            }
            float x_sum = len > 0 ? sum8(total) : 0.0f;
            /* a NaN input makes its row's outputs NaN, as a float product would (an infinite one already
             * does: its group's scale is infinite, times a zero sum) */
            xs[m * groups + g] = isnan(x_sum) ? NAN : amax / 127.0f;
            sums[m * groups + g] = sum;
            x_sums[m * groups + g] = x_sum;
        }
    }
}

/* A kernel's tile: mr (<= ROWS) rows of block b into out[i * LANES + c]. */
typedef void (*tile_fn)(int mr, const quantized_rows *rows, int64_t b, const void *weight, float *out);

/* y [rows, n_out] = the kernel's product of x [rows, k_in] (quantized here in groups of ``group``
 * inputs, k_pad = k_in rounded up to 4) with ``weight`` by its ``tile``.  Returns 0; -1 where its
 * scratch could not be allocated. */
static int vnni_product(const float *x, int64_t rows, int64_t k_in, int64_t group, int64_t n_out, tile_fn tile,
                        const void *weight, float *y) {
    int64_t k_pad = (k_in + 3) & ~(int64_t)3, groups = (k_pad + group - 1) / group;
    int64_t blocks = (n_out + LANES - 1) / LANES, chunks = (blocks + CHUNK - 1) / CHUNK;
    int8_t *xq = malloc((size_t)(rows * k_pad) + 64);
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(rows * groups) + 64);
    float *x_sums = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    if (!xq || !xs || !sums || !x_sums) {
        free(xq), free(xs), free(sums), free(x_sums);
        return -1;
    }
    quantize_rows(x, rows, k_in, k_pad, group, xq, xs, sums, x_sums);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t b_end = (c + 1) * CHUNK < blocks ? (c + 1) * CHUNK : blocks;
        float out[ROWS * LANES];
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
            quantized_rows part = {xq + m0 * k_pad, xs + m0 * groups, sums + m0 * groups, x_sums + m0 * groups,
                                   k_pad, groups, group};
            for (int64_t b = c * CHUNK; b < b_end; b++) {
                tile(mr, &part, b, weight, out);
                int64_t n0 = b * LANES, width = n_out - n0 < LANES ? n_out - n0 : LANES;
                for (int i = 0; i < mr; i++)
                    memcpy(y + (m0 + i) * n_out + n0, out + i * LANES, sizeof(float) * (size_t)width);
            }
        }
    }
    free(xq), free(xs), free(sums), free(x_sums);
    return 0;
}
#endif
