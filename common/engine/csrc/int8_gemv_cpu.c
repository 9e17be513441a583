/* y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]: the product of a few activation rows (a decode
 * step) with an int8 weight of per-output-channel scales, reading each weight byte once per step.
 *
 * The weight is packed in blocks of 8 output channels, k-major: qp[n / 8][k][n % 8] (the last
 * block zero-padded), so one 8-byte load at k gives the 8 channels' weights, widened to one fp32
 * vector and multiplied into 8 row accumulators with no horizontal sums.  Decode is bound by
 * reading weights: int8 is a quarter of fp32's bytes.  Blocks of channels are split between
 * OpenMP threads.  Built with -march=native (cpu_kernels.py); a scalar loop where there is no AVX2.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS 8 /* rows per pass over the weights; more rows take more passes */

#ifdef __AVX2__
#define DEFINE_BLOCK(MR)                                                                            \
    static inline void block_##MR(const float *x, int64_t k_in, const int8_t *w, __m256 *acc) {      \
        __m256 a[MR];                                                                               \
        for (int i = 0; i < MR; i++) a[i] = _mm256_setzero_ps();                                    \
        for (int64_t k = 0; k < k_in; k++) {                                                        \
            __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8 * k)))); \
            for (int i = 0; i < MR; i++) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * k_in + k), wv, a[i]); \
        }                                                                                           \
        for (int i = 0; i < MR; i++) acc[i] = a[i];                                                 \
    }
DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)
DEFINE_BLOCK(7)
DEFINE_BLOCK(8)
#endif

void int8_gemv_f32(const float *x, int64_t rows, const int8_t *qp, const float *scale, float *y,
                   int64_t n_out, int64_t k_in) {
    int64_t blocks = (n_out + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *w = qp + b * k_in * 8;
        int64_t width = n_out - b * 8 < 8 ? n_out - b * 8 : 8;
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);
            float out[ROWS][8];
#ifdef __AVX2__
            __m256 acc[ROWS];
            const float *xm = x + m0 * k_in;
            switch (mr) {
                case 1: block_1(xm, k_in, w, acc); break;
                case 2: block_2(xm, k_in, w, acc); break;
                case 3: block_3(xm, k_in, w, acc); break;
                case 4: block_4(xm, k_in, w, acc); break;
                case 5: block_5(xm, k_in, w, acc); break;
                case 6: block_6(xm, k_in, w, acc); break;
                case 7: block_7(xm, k_in, w, acc); break;
                default: block_8(xm, k_in, w, acc); break;
            }
            for (int i = 0; i < mr; i++) _mm256_storeu_ps(out[i], acc[i]);
#else
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < 8; j++) out[i][j] = 0.0f;
            for (int64_t k = 0; k < k_in; k++)
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < 8; j++) out[i][j] += x[(m0 + i) * k_in + k] * (float)w[8 * k + j];
#endif
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < width; j++) y[(m0 + i) * n_out + b * 8 + j] = out[i][j] * scale[b * 8 + j];
        }
    }
}
