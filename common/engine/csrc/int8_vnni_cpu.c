/* y[m, n] = scale[n] * sum_g xs[m, g] * sum_{k in g} xq[m, k] * q[n, k]: an int8 weight (per output
 * channel scales) times activations quantized to int8 on the fly, in groups of ``group`` inputs
 * (one scale per row and group), on CPUs with AVX512-VNNI.
 *
 * Why: with the weight in int8 a decode step reads a quarter of fp32's bytes, but widening every
 * weight to fp32 (or bf16) for the product makes the step compute-bound on a 2-core machine (the
 * fp32 kernel, int8_gemv_cpu.c, runs below the bandwidth from 8 rows on).  _mm512_dpbusd_epi32 adds
 * 4 byte products into each of 16 int32 lanes: 64 multiply-adds an instruction, with no widening.
 * The activations' quantization is what it costs in quality: per row and group of inputs (a row's
 * one huge channel -- Gemma's hidden states have them -- then only coarsens its own group), measured
 * by benchmarks/quant_quality.py.
 *
 * Layout: the weight in blocks of 16 output channels and quads of 4 inputs,
 * w[n / 16][k / 4][n % 16][k % 4], stored as q + 128 (unsigned: dpbusd multiplies unsigned bytes by
 * signed ones), inputs zero-padded to a multiple of 4 and channels to a multiple of 16.  One 64-byte
 * load is a quad of all 16 channels; the row's quad of int8 activations is broadcast to every lane.
 * The +128 adds 128 * sum_{k in g} xq[m, k] to each group's sum, subtracted in int32 (exact) before
 * the group's sum is converted and scaled: every group's integer sum is exact, and the result depends
 * only on the row's own values (not on the rows beside it, nor on how the blocks were split).
 *
 * Blocks of channels are split between OpenMP threads in chunks of CHUNK blocks; within a chunk, rows
 * go 8 at a time, and fewer rows take several blocks a pass (more independent accumulator chains).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define ROWS 8   /* rows a pass over a block */
#define LANES 16 /* output channels a block */
#define CHUNK 4  /* blocks a thread takes at a time */
#define PARALLEL_MIN (1 << 16) /* inputs to quantize before rows are split among threads */
/* Weight bytes ahead that tiles of 5-8 rows prefetch: with 8 dpbusd a cache line the hardware
 * prefetchers alone fall behind (an A/B in one process on a Zen 4: 8 rows through the LM head
 * 5.9 -> 5.1 ms, the layers' products -10%); with 1-4 rows they keep up, and prefetching costs. */
#define PREFETCH_BYTES 2048

/* Rows [rows, k_in] of x into xq [rows, k_pad] (int8, the pad zero), xs [rows, groups] (the groups'
 * scales: amax / 127) and corr [rows, groups] (128 * sum of the group's xq). */
static void quantize_rows(const float *x, int64_t rows, int64_t k_in, int64_t k_pad, int64_t group, int8_t *xq,
                          float *xs, int32_t *corr) {
    int64_t groups = (k_pad + group - 1) / group;
#pragma omp parallel for schedule(static) if (rows * k_pad >= PARALLEL_MIN)
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * k_in;
        int8_t *qm = xq + m * k_pad;
        memset(qm, 0, (size_t)k_pad);
        for (int64_t g = 0; g < groups; g++) {
            int64_t start = g * group, len = k_in - start < group ? k_in - start : group;
            __m512 top = _mm512_setzero_ps();
            for (int64_t j = 0; j < len; j += 16) {
                __mmask16 mask = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
                top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, xm + start + j)));
            }
            float amax = len > 0 ? _mm512_reduce_max_ps(top) : 0.0f;
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512i sum = _mm512_setzero_si512();
            for (int64_t j = 0; j < len; j += 16) {
                __mmask16 mask = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xm + start + j), _mm512_set1_ps(inverse));
                __m512i q = _mm512_cvtps_epi32(v); /* round to nearest, ties to even */
                sum = _mm512_add_epi32(sum, q);
                _mm512_mask_cvtepi32_storeu_epi8(qm + start + j, mask, q);
            }
            xs[m * groups + g] = amax / 127.0f;
            corr[m * groups + g] = 128 * _mm512_reduce_add_epi32(sum);
        }
    }
}

static inline __m512i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* MR rows by NB consecutive blocks (block j's bytes at w + j * k_pad * LANES): out[j * MR + i]. */
#define DEFINE_TILE(MR, NB)                                                                           \
    static inline void tile_##MR##_##NB(const int8_t *xq, int64_t k_pad, const float *xs,             \
                                        const int32_t *corr, int64_t groups, int64_t group,            \
                                        const uint8_t *w, __m512 *out) {                               \
        __m512 f[NB][MR];                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) f[j][i] = _mm512_setzero_ps();                               \
        for (int64_t g = 0; g < groups; g++) {                                                        \
            int64_t k0 = g * group, k1 = k0 + group < k_pad ? k0 + group : k_pad;                     \
            __m512i a[NB][MR];                                                                        \
            for (int j = 0; j < NB; j++)                                                              \
                for (int i = 0; i < MR; i++) a[j][i] = _mm512_set1_epi32(-corr[i * groups + g]);      \
            for (int64_t k = k0; k < k1; k += 4)                                                      \
                for (int j = 0; j < NB; j++) {                                                        \
                    if (MR >= 5)                                                                      \
                        _mm_prefetch((const char *)(w + j * k_pad * LANES + k * LANES) + PREFETCH_BYTES, _MM_HINT_T0); \
                    __m512i wv = _mm512_loadu_si512((const void *)(w + j * k_pad * LANES + k * LANES)); \
                    for (int i = 0; i < MR; i++)                                                      \
                        a[j][i] = _mm512_dpbusd_epi32(a[j][i], wv, broadcast_quad(xq + i * k_pad + k)); \
                }                                                                                     \
            for (int i = 0; i < MR; i++) {                                                            \
                __m512 s = _mm512_set1_ps(xs[i * groups + g]);                                        \
                for (int j = 0; j < NB; j++) f[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j][i]), s, f[j][i]); \
            }                                                                                         \
        }                                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) out[j * MR + i] = f[j][i];                                   \
    }
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1) DEFINE_TILE(6, 1) DEFINE_TILE(7, 1) DEFINE_TILE(8, 1)
DEFINE_TILE(1, 4) DEFINE_TILE(2, 4) DEFINE_TILE(3, 2) DEFINE_TILE(4, 2)

/* out[j * mr + i]: row m0 + i of block b0 + j, times the channels' scales, into y. */
static inline void store_tile(const __m512 *out, int mr, int nb, int64_t m0, int64_t b0, const float *scale,
                              float *y, int64_t n_out) {
    for (int j = 0; j < nb; j++) {
        int64_t n0 = (b0 + j) * LANES, width = n_out - n0 < LANES ? n_out - n0 : LANES;
        __mmask16 mask = width == LANES ? 0xFFFF : (__mmask16)((1u << width) - 1);
        __m512 s = _mm512_maskz_loadu_ps(mask, scale + n0);
        for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + (m0 + i) * n_out + n0, mask, _mm512_mul_ps(out[j * mr + i], s));
    }
}

static void tile(int mr, int nb, const int8_t *xq, int64_t k_pad, const float *xs, const int32_t *corr,
                 int64_t groups, int64_t group, const uint8_t *w, __m512 *out) {
#define CASE(MR, NB) if (mr == MR && nb == NB) { tile_##MR##_##NB(xq, k_pad, xs, corr, groups, group, w, out); return; }
    CASE(1, 4) CASE(2, 4) CASE(3, 2) CASE(4, 2)
    CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) CASE(5, 1) CASE(6, 1) CASE(7, 1) CASE(8, 1)
#undef CASE
}

/* Blocks a pass for mr rows: enough independent chains to hide dpbusd's latency. */
static inline int blocks_per_pass(int mr) { return mr <= 2 ? 4 : mr <= 4 ? 2 : 1; }

/* y [rows, n_out] (fp32) = x [rows, k_in] (fp32) times the weight w (the layout above, k_pad = k_in
 * rounded up to 4) with per-channel ``scale``; activations quantized in groups of ``group`` inputs (a
 * multiple of 4).  Returns 0, or -1 where its scratch could not be allocated. */
int int8_vnni_gemm(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale, float *y,
                   int64_t n_out, int64_t group) {
    int64_t k_pad = (k_in + 3) & ~(int64_t)3, groups = (k_pad + group - 1) / group;
    int64_t blocks = (n_out + LANES - 1) / LANES, chunks = (blocks + CHUNK - 1) / CHUNK;
    int8_t *xq = malloc((size_t)(rows * k_pad) + 64);
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)(rows * groups) + 64);
    if (!xq || !xs || !corr) {
        free(xq), free(xs), free(corr);
        return -1;
    }
    quantize_rows(x, rows, k_in, k_pad, group, xq, xs, corr);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t b_end = (c + 1) * CHUNK < blocks ? (c + 1) * CHUNK : blocks;
        __m512 out[ROWS];
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            int mr = (int)(rows - m0 < ROWS ? rows - m0 : ROWS), wide = blocks_per_pass(mr);
            const int8_t *xm = xq + m0 * k_pad;
            const float *sm = xs + m0 * groups;
            const int32_t *cm = corr + m0 * groups;
            for (int64_t b = c * CHUNK; b < b_end;) {
                int nb = b + wide <= b_end ? wide : 1;
                tile(mr, nb, xm, k_pad, sm, cm, groups, group, w + b * k_pad * LANES, out);
                store_tile(out, mr, nb, m0, b, scale, y, n_out);
                b += nb;
            }
        }
    }
    free(xq), free(xs), free(corr);
    return 0;
}
#endif
