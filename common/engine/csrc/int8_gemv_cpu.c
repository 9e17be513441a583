/* y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]: the product of a few activation rows (a decode
 * step) with an int8 weight of per-output-channel scales, reading each weight byte once per step.
 *
 * The weight is packed in blocks of 8 output channels, k-major: qp[n / 8][k][n % 8] (the last
 * block zero-padded), so one 8-byte load at k gives the 8 channels' weights, widened to one fp32
 * vector and multiplied into 8 row accumulators with no horizontal sums.  Decode is bound by
 * reading weights: int8 is a quarter of fp32's bytes.  Blocks of channels are split between
 * OpenMP threads.  Built with -march=native (cpu_kernels.py); a scalar loop where there is no AVX2.
 *
 * With few rows a block's accumulators are one chain of dependent FMAs per row, which waits on the
 * FMA's latency (4 cycles) at every k: 1 row computed at a quarter of the FMA units' rate, slower
 * than reading the weight.  So 1-2 rows take GROUP blocks at once and 3-4 rows two, for GROUP (or
 * two) times the independent chains; with AVX-512, 5-8 rows take two blocks in one 16-lane vector
 * (half the instructions).  Each output still adds its k products in ascending order, one FMA
 * each, so the result does not depend on how many rows or blocks share a pass.
 *
 * int8_gemv_bf16: the same product for bf16 activation rows on CPUs with AVX512-BF16.  Two blocks of
 * 8 channels at a time, two inputs per instruction: the bytes of inputs k and k+1 are interleaved
 * into (k, k+1) pairs per channel, widened to bf16 (exact: every int8 is a bf16), and
 * _mm512_dpbf16_ps adds x[k] * w[k] + x[k+1] * w[k+1] into 16 fp32 sums, one per channel.  With 8
 * rows that is a third of the instructions of the fp32 loop per weight, which at decode batch sizes
 * is compute-bound, not bound by reading weights.
 *
 * int8_gemv_argmax: each row's first maximal output of int8_gemv_f32 without writing the outputs (an
 * int8 LM head's greedy tokens where int8_vnni_cpu.c has no build).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS 8 /* rows per pass over the weights; more rows take more passes */
#define GROUP 4 /* blocks of 8 channels a thread takes at a time (and a pass of 1-2 rows computes) */

#ifdef __AVX2__
/* MR rows by NB consecutive blocks (the weights of block j at w + j * k_in * 8): acc[j * MR + i]. */
#define DEFINE_WIDE(MR, NB)                                                                         \
    static inline void wide_##MR##_##NB(const float *x, int64_t k_in, const int8_t *w, __m256 *acc) { \
        __m256 a[NB][MR];                                                                           \
        for (int j = 0; j < NB; j++)                                                                \
            for (int i = 0; i < MR; i++) a[j][i] = _mm256_setzero_ps();                             \
        for (int64_t k = 0; k < k_in; k++)                                                          \
            for (int j = 0; j < NB; j++) {                                                          \
                __m256 wv = _mm256_cvtepi32_ps(                                                     \
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + j * k_in * 8 + 8 * k)))); \
                for (int i = 0; i < MR; i++)                                                        \
                    a[j][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * k_in + k), wv, a[j][i]);  \
            }                                                                                       \
        for (int j = 0; j < NB; j++)                                                                \
            for (int i = 0; i < MR; i++) acc[j * MR + i] = a[j][i];                                 \
    }
#ifdef __AVX512F__
/* MR rows by two consecutive blocks in one 16-lane vector (block b's channels in lanes 0-7, block
 * b + 1's in 8-15): half the FMA instructions of two 8-lane passes, the same sum in each lane. */
#define DEFINE_PAIR16(MR)                                                                           \
    static inline void pair16_##MR(const float *x, int64_t k_in, const int8_t *w, __m256 *acc) {     \
        __m512 a[MR];                                                                               \
        for (int i = 0; i < MR; i++) a[i] = _mm512_setzero_ps();                                    \
        for (int64_t k = 0; k < k_in; k++) {                                                        \
            __m128i lo = _mm_loadl_epi64((const __m128i *)(w + 8 * k));                             \
            __m128i hi = _mm_loadl_epi64((const __m128i *)(w + k_in * 8 + 8 * k));                  \
            __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi)));       \
            for (int i = 0; i < MR; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k_in + k]), wv, a[i]); \
        }                                                                                           \
        for (int i = 0; i < MR; i++) {                                                              \
            acc[i] = _mm512_castps512_ps256(a[i]);                                                  \
            acc[MR + i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1));           \
        }                                                                                           \
    }
DEFINE_PAIR16(5)
DEFINE_PAIR16(6)
DEFINE_PAIR16(7)
DEFINE_PAIR16(8)
#endif

DEFINE_WIDE(1, 1) DEFINE_WIDE(2, 1) DEFINE_WIDE(3, 1) DEFINE_WIDE(4, 1)
DEFINE_WIDE(5, 1) DEFINE_WIDE(6, 1) DEFINE_WIDE(7, 1) DEFINE_WIDE(8, 1)
DEFINE_WIDE(1, 4)
DEFINE_WIDE(2, 4)
DEFINE_WIDE(3, 2)
DEFINE_WIDE(4, 2)

/* acc[j * mr + i]: row m0 + i of block b0 + j, scaled into y. */
static inline void store_blocks(const __m256 *acc, int mr, int nb, int64_t m0, int64_t b0, const float *scale,
                                float *y, int64_t n_out) {
    for (int j = 0; j < nb; j++) {
        int64_t b = b0 + j, width = n_out - b * 8 < 8 ? n_out - b * 8 : 8;
        for (int i = 0; i < mr; i++) {
            float out[8];
            _mm256_storeu_ps(out, acc[j * mr + i]);
            for (int c = 0; c < width; c++) y[(m0 + i) * n_out + b * 8 + c] = out[c] * scale[b * 8 + c];
        }
    }
}

/* Rows [m0, m0 + mr) by blocks [b0, b0 + nb): as many blocks a pass as the row count wants. */
static void product_blocks(const float *x, int64_t m0, int mr, const int8_t *qp, int64_t b0, int nb,
                           const float *scale, float *y, int64_t n_out, int64_t k_in) {
    const float *xm = x + m0 * k_in;
    __m256 acc[ROWS * GROUP];
    int64_t b = b0;
    if (mr <= 2)
        for (; b + GROUP <= b0 + nb; b += GROUP) {
            if (mr == 1) wide_1_4(xm, k_in, qp + b * k_in * 8, acc);
            else wide_2_4(xm, k_in, qp + b * k_in * 8, acc);
            store_blocks(acc, mr, GROUP, m0, b, scale, y, n_out);
        }
    else if (mr <= 4)
        for (; b + 2 <= b0 + nb; b += 2) {
            if (mr == 3) wide_3_2(xm, k_in, qp + b * k_in * 8, acc);
            else wide_4_2(xm, k_in, qp + b * k_in * 8, acc);
            store_blocks(acc, mr, 2, m0, b, scale, y, n_out);
        }
#ifdef __AVX512F__
    else
        for (; b + 2 <= b0 + nb; b += 2) {
            const int8_t *w = qp + b * k_in * 8;
            switch (mr) {
                case 5: pair16_5(xm, k_in, w, acc); break;
                case 6: pair16_6(xm, k_in, w, acc); break;
                case 7: pair16_7(xm, k_in, w, acc); break;
                default: pair16_8(xm, k_in, w, acc); break;
            }
            store_blocks(acc, mr, 2, m0, b, scale, y, n_out);
        }
#endif
    for (; b < b0 + nb; b++) {
        const int8_t *w = qp + b * k_in * 8;
        switch (mr) {
            case 1: wide_1_1(xm, k_in, w, acc); break;
            case 2: wide_2_1(xm, k_in, w, acc); break;
            case 3: wide_3_1(xm, k_in, w, acc); break;
            case 4: wide_4_1(xm, k_in, w, acc); break;
            case 5: wide_5_1(xm, k_in, w, acc); break;
            case 6: wide_6_1(xm, k_in, w, acc); break;
            case 7: wide_7_1(xm, k_in, w, acc); break;
            default: wide_8_1(xm, k_in, w, acc); break;
        }
        store_blocks(acc, mr, 1, m0, b, scale, y, n_out);
    }
}
#endif

void int8_gemv_f32(const float *x, int64_t rows, const int8_t *qp, const float *scale, float *y,
                   int64_t n_out, int64_t k_in) {
    int64_t blocks = (n_out + 7) / 8, groups = (blocks + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b0 = g * GROUP;
        int nb = (int)(blocks - b0 < GROUP ? blocks - b0 : GROUP);
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
#ifdef __AVX2__
            product_blocks(x, m0, mr, qp, b0, nb, scale, y, n_out, k_in);
#else
            for (int64_t b = b0; b < b0 + nb; b++) {
                const int8_t *w = qp + b * k_in * 8;
                int64_t width = n_out - b * 8 < 8 ? n_out - b * 8 : 8;
                float out[ROWS][8];
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < 8; j++) out[i][j] = 0.0f;
                for (int64_t k = 0; k < k_in; k++)
                    for (int i = 0; i < mr; i++)
                        for (int j = 0; j < 8; j++) out[i][j] += x[(m0 + i) * k_in + k] * (float)w[8 * k + j];
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < width; j++) y[(m0 + i) * n_out + b * 8 + j] = out[i][j] * scale[b * 8 + j];
            }
#endif
        }
    }
}

#ifdef __AVX2__
/* tokens[row] = the first index of row's largest output of int8_gemv_f32 (an LM head's greedy tokens
 * without its logits: no n_out floats a row written and read back).  Each group of GROUP blocks is
 * computed as int8_gemv_f32 computes it -- the same blocks a pass, the same sums and the same scaling
 * -- into a small buffer, whose rows' first maxima (a later channel only when strictly larger) are
 * then taken in the groups' order.  Returns 0; 1 where an output was not finite (tokens unset: the
 * caller takes the logits); -1 where its scratch could not be allocated.  (On CPUs with AVX2.) */
int int8_gemv_argmax(const float *x, int64_t rows, const int8_t *qp, const float *scale, int64_t n_out,
                     int64_t k_in, int64_t *tokens) {
    int64_t blocks = (n_out + 7) / 8, groups = (blocks + GROUP - 1) / GROUP;
    float *best = malloc(sizeof(float) * (size_t)(groups * rows) + 64);
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(groups * rows) + 64);
    if (!best || !index) {
        free(best), free(index);
        return -1;
    }
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b0 = g * GROUP, n0 = b0 * 8;
        int nb = (int)(blocks - b0 < GROUP ? blocks - b0 : GROUP);
        int64_t width = n_out - n0 < GROUP * 8 ? n_out - n0 : GROUP * 8;
        float y[ROWS * GROUP * 8];
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
            /* rows m0.. of this group's channels: y[i * width + c] */
            product_blocks(x + m0 * k_in, 0, mr, qp + b0 * k_in * 8, 0, nb, scale + n0, y, width, k_in);
            for (int i = 0; i < mr; i++) {
                float top = -INFINITY;
                int64_t at = -1;
                for (int64_t c = 0; c < width; c++) {
                    float v = y[i * width + c];
                    if (!(fabsf(v) < INFINITY)) bad = 1; /* an infinity or a NaN */
                    if (v > top) top = v, at = n0 + c;
                }
                best[g * rows + m0 + i] = top, index[g * rows + m0 + i] = at;
            }
        }
    }
    if (!bad)
        for (int64_t m = 0; m < rows; m++) {
            float top = -INFINITY;
            tokens[m] = -1;
            for (int64_t g = 0; g < groups; g++)
                if (best[g * rows + m] > top) top = best[g * rows + m], tokens[m] = index[g * rows + m];
        }
    free(best), free(index);
    return bad;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* Inputs k and k+1 of one 8-channel block as 16 fp32 values, (k, k+1) pairs per channel;
 * ``second`` is 0 past the last input (an odd count). */
static inline __m512 pair_values(const int8_t *w, int64_t k, int second) {
    __m128i a = _mm_loadl_epi64((const __m128i *)(w + 8 * k));
    __m128i b = second ? _mm_loadl_epi64((const __m128i *)(w + 8 * k + 8)) : _mm_setzero_si128();
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
}

#define DEFINE_PAIR_BLOCK(MR)                                                                       \
    static inline void pair_block_##MR(const uint32_t *x, int64_t x_pairs, int64_t k_in,             \
                                       const int8_t *w0, const int8_t *w1, __m512 *acc) {            \
        __m512 a[MR];                                                                               \
        for (int i = 0; i < MR; i++) a[i] = _mm512_setzero_ps();                                    \
        for (int64_t k = 0; k < k_in; k += 2) {                                                     \
            int second = k + 1 < k_in;                                                              \
            __m512 lo = pair_values(w0, k, second);                                                 \
            __m512 hi = w1 ? pair_values(w1, k, second) : _mm512_setzero_ps();                      \
            __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);                                              \
            for (int i = 0; i < MR; i++)                                                            \
                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32((int)x[i * x_pairs + k / 2]), wv); \
        }                                                                                           \
        for (int i = 0; i < MR; i++) acc[i] = a[i];                                                 \
    }
DEFINE_PAIR_BLOCK(1)
DEFINE_PAIR_BLOCK(2)
DEFINE_PAIR_BLOCK(3)
DEFINE_PAIR_BLOCK(4)
DEFINE_PAIR_BLOCK(5)
DEFINE_PAIR_BLOCK(6)
DEFINE_PAIR_BLOCK(7)
DEFINE_PAIR_BLOCK(8)

/* y[m, n] (fp32) for bf16 rows ``x`` [rows, k_pad] (k_pad: k_in rounded up to even, the pad zero). */
void int8_gemv_bf16(const uint16_t *x, int64_t rows, const int8_t *qp, const float *scale, float *y,
                    int64_t n_out, int64_t k_in) {
    int64_t blocks = (n_out + 7) / 8, k_pad = (k_in + 1) & ~(int64_t)1;
#pragma omp parallel for schedule(static)
    for (int64_t pb = 0; pb < (blocks + 1) / 2; pb++) {
        int64_t b0 = 2 * pb;
        const int8_t *w0 = qp + b0 * k_in * 8;
        const int8_t *w1 = b0 + 1 < blocks ? w0 + k_in * 8 : 0;
        int64_t channels = n_out - b0 * 8 < 16 ? n_out - b0 * 8 : 16;
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
            const uint32_t *xm = (const uint32_t *)(x + m0 * k_pad);
            __m512 acc[ROWS];
            switch (mr) {
                case 1: pair_block_1(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 2: pair_block_2(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 3: pair_block_3(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 4: pair_block_4(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 5: pair_block_5(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 6: pair_block_6(xm, k_pad / 2, k_in, w0, w1, acc); break;
                case 7: pair_block_7(xm, k_pad / 2, k_in, w0, w1, acc); break;
                default: pair_block_8(xm, k_pad / 2, k_in, w0, w1, acc); break;
            }
            for (int i = 0; i < mr; i++) {
                float out[16];
                _mm512_storeu_ps(out, acc[i]);
                for (int j = 0; j < channels; j++) y[(m0 + i) * n_out + b0 * 8 + j] = out[j] * scale[b0 * 8 + j];
            }
        }
    }
}
#endif
