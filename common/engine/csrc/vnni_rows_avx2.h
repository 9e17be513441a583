/* vnni_rows.h's counterpart on CPUs with AVX2 and FMA but no AVX512-VNNI (int8_vnni_cpu.c's and
 * int4_vnni_cpu.c's second builds): the same activations' quantization -- per row and group of
 * ``group`` inputs, symmetric, xq = round(x * 127 / amax) (ties to even), scale amax / 127 -- and a
 * driver that splits blocks of 16 output channels among OpenMP threads (chunks of CHUNK blocks;
 * within a chunk rows 4 at a time, one block a pass: with 8-lane vectors a tile of 4 rows by 16
 * channels already holds every register).  A tile writes its rows' 16 sums to out[i * LANES + c],
 * which the driver scales by the channels' scales (where the kernel has them) into y, or folds into
 * each row's best output (a greedy LM head's tokens, as vnni_rows.h does).
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

/* Row i's outputs of a tile (out[i * LANES + c] times the channels' scales, as the stores compute
 * them) folded lane by lane into best[2 i + h] / index[2 i + h] (channels 8 h .. 8 h + 7 of every
 * block): a later block replaces a lane's value only when strictly larger, so each lane keeps its
 * first maximal channel; a value that is not finite sets *bad (the caller then takes the logits). */
static inline void best_of_tile(const float *out, int mr, int64_t b, const float *scale, int64_t n_out,
                                __m256 *best, __m256i *index, int *bad) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
    for (int h = 0; h < 2; h++) {
        const int64_t n0 = b * LANES + 8 * h;
        if (n0 >= n_out) break;
        const int64_t width = n_out - n0 < 8 ? n_out - n0 : 8;
        const __m256i channel = _mm256_add_epi32(_mm256_set1_epi32((int32_t)n0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)width),
                                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        float part[8];
        const __m256 s = scale ? load8(scale + n0, width, part) : _mm256_set1_ps(1.0f);
        for (int i = 0; i < mr; i++) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(out + i * LANES + 8 * h), s);
            /* |v| not below infinity: an infinity or a NaN */
            const __m256 not_finite = _mm256_and_ps(valid, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), inf, _CMP_NLT_UQ));
            if (_mm256_movemask_ps(not_finite)) *bad = 1;
            const __m256 above = _mm256_and_ps(valid, _mm256_cmp_ps(v, best[2 * i + h], _CMP_GT_OQ));
            best[2 * i + h] = _mm256_blendv_ps(best[2 * i + h], v, above);
            index[2 * i + h] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(index[2 * i + h]),
                                                                    _mm256_castsi256_ps(channel), above));
        }
    }
}

/* A row's largest value over the lanes of best[0..1] and the first channel that holds it (the lowest
 * among the lanes that hold it: each lane's is its first), into *top / *at. */
static inline void best_of_lanes(const __m256 *best, const __m256i *index, float *top, int64_t *at) {
    const float t = max8(_mm256_max_ps(best[0], best[1]));
    int32_t first = -1;
    for (int h = 0; h < 2; h++) {
        float v[8];
        int32_t c[8];
        _mm256_storeu_ps(v, best[h]);
        _mm256_storeu_si256((__m256i *)c, index[h]);
        for (int l = 0; l < 8; l++)
            if (v[l] == t && c[l] >= 0 && (first < 0 || c[l] < first)) first = c[l];
    }
    *top = t;
    *at = first;
}

/* y [rows, n_out] = the kernel's product of x [rows, k_in] (quantized here in groups of ``group``
 * inputs, k_pad = k_in rounded up to 4) with ``weight`` by its ``tile``, times ``scale`` (NULL: none);
 * or, with ``argmax`` (y unused), each row's first maximal output index into argmax[row] -- the index
 * torch.argmax of y would give -- without y's n_out values a row.  Returns 0; 1 (argmax only) where
 * some output was not finite (argmax then unset); -1 where its scratch could not be allocated. */
static int vnni_product(const float *x, int64_t rows, int64_t k_in, int64_t group, int64_t n_out, tile_fn tile,
                        const void *weight, const float *scale, float *y, int64_t *argmax) {
    int64_t k_pad = (k_in + 3) & ~(int64_t)3, groups = (k_pad + group - 1) / group;
    int64_t blocks = (n_out + LANES - 1) / LANES, chunks = (blocks + CHUNK - 1) / CHUNK;
    int8_t *xq = malloc((size_t)(rows * k_pad) + 64);
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(rows * groups) + 64);
    float *x_sums = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    /* argmax: each chunk's best value and index a row, reduced in chunk order below */
    float *best = argmax ? malloc(sizeof(float) * (size_t)(chunks * rows)) : NULL;
    int64_t *index = argmax ? malloc(sizeof(int64_t) * (size_t)(chunks * rows)) : NULL;
    if (!xq || !xs || !sums || !x_sums || (argmax && (!best || !index))) {
        free(xq), free(xs), free(sums), free(x_sums), free(best), free(index);
        return -1;
    }
    quantize_rows(x, rows, k_in, k_pad, group, xq, xs, sums, x_sums);
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t b_end = (c + 1) * CHUNK < blocks ? (c + 1) * CHUNK : blocks;
        float out[ROWS * LANES];
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
            quantized_rows part = {xq + m0 * k_pad, xs + m0 * groups, sums + m0 * groups, x_sums + m0 * groups,
                                   k_pad, groups, group, m0 == 0};
            __m256 lane_best[2 * ROWS];
            __m256i lane_index[2 * ROWS];
            for (int i = 0; argmax && i < 2 * mr; i++)
                lane_best[i] = _mm256_set1_ps(-INFINITY), lane_index[i] = _mm256_set1_epi32(-1);
            for (int64_t b = c * CHUNK; b < b_end; b++) {
                tile(mr, &part, b, weight, out);
                if (argmax) {
                    best_of_tile(out, mr, b, scale, n_out, lane_best, lane_index, &bad);
                    continue;
                }
                int64_t n0 = b * LANES, width = n_out - n0 < LANES ? n_out - n0 : LANES;
                for (int i = 0; i < mr; i++) {
                    float *row = y + (m0 + i) * n_out + n0;
                    const float *o = out + i * LANES;
                    for (int64_t c = 0; c < width; c++) row[c] = scale ? o[c] * scale[n0 + c] : o[c];
                }
            }
            if (argmax)
                for (int i = 0; i < mr; i++)
                    best_of_lanes(lane_best + 2 * i, lane_index + 2 * i, best + c * rows + m0 + i, index + c * rows + m0 + i);
        }
    }
    if (argmax && !bad) best_of_chunks(best, index, rows, chunks, argmax);
    free(xq), free(xs), free(sums), free(x_sums), free(best), free(index);
    return argmax && bad ? 1 : 0;
}
#endif
