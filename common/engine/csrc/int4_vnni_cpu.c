/* y[m, n] = sum_g (scale[n, g] * xs[m, g] * S[m, n, g] + zero[n, g] * X[m, g]), with
 * S[m, n, g] = sum_{k in g} xq[m, k] * (q[n, k] - 8) and X[m, g] = sum_{k in g} x[m, k]: a 4-bit weight
 * in groups of ``group`` inputs, w = (q - 8) * scale + zero (q in 0..15), times activations quantized
 * to int8 in the same groups (vnni_rows.h), on CPUs with AVX512-VNNI -- or, with the same layout,
 * arithmetic and results, on CPUs with AVX2 and FMA (below).  The zero points multiply the
 * activations' own sums, not their quantized ones: a group whose weights share a large offset would
 * otherwise scale the activations' rounding by it.
 *
 * The int4 counterpart of int8_vnni_cpu.c: half the weight bytes, the same dpbusd products (the
 * 4-bit values, 0..15, are its unsigned operand as stored), each group's integer sum exact (the -8
 * taken back in int32 as 8 x the group's sum of xq), then scaled per channel and group.  Layout: blocks of 16 output channels by 8 inputs, 64 bytes each: byte 4 c + j of the block
 * at inputs k..k+7 holds q[c, k + j] in its low nibble and q[c, k + 4 + j] in its high one, so one
 * load is two quads of all 16 channels (an AND and a shift apart).  ``scale`` and ``zero`` are
 * [n / 16][groups][16] fp32.
 * Inputs are a multiple of the group size, itself a multiple of 8.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "vnni_rows.h"

typedef struct {
    const uint8_t *w;
    const float *scale, *zero;
} int4_weight;

/* MR rows by NB consecutive blocks (block j's bytes at w + j * k_pad * 8, its scales and zeros at
 * cs / cz + j * groups * LANES): out[j * MR + i]. */
#define DEFINE_TILE(MR, NB)                                                                           \
    static inline void tile_##MR##_##NB(const quantized_rows *r, const uint8_t *w, const float *cs,   \
                                        const float *cz, __m512 *out) {                               \
        const int64_t k_pad = r->k_pad, groups = r->groups, group = r->group;                         \
        const int8_t *xq = r->xq;                                                                     \
        const float *xs = r->xs;                                                                      \
        const int32_t *sums = r->sums;                                                                \
        const float *x_sums = r->x_sums;                                                              \
        const __m512i nibble = _mm512_set1_epi8(0x0F);                                                \
        __m512 f[NB][MR];                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) f[j][i] = _mm512_setzero_ps();                               \
        for (int64_t g = 0; g < groups; g++) {                                                        \
            __m512i s[NB][MR];                                                                        \
            for (int j = 0; j < NB; j++)                                                              \
                for (int i = 0; i < MR; i++) s[j][i] = _mm512_set1_epi32(-8 * sums[i * groups + g]);  \
            for (int64_t k = g * group; k < (g + 1) * group; k += 8)                                  \
                for (int j = 0; j < NB; j++) {                                                        \
                    const uint8_t *p = w + j * k_pad * 8 + k * 8;                                     \
                    PREFETCH_WEIGHT(MR, p);                                                           \
                    __m512i v = _mm512_loadu_si512((const void *)p);                                  \
                    __m512i lo = _mm512_and_si512(v, nibble);                                         \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);                   \
                    for (int i = 0; i < MR; i++) {                                                    \
                        s[j][i] = dpbusd(s[j][i], lo, broadcast_quad(xq + i * k_pad + k));            \
                        s[j][i] = dpbusd(s[j][i], hi, broadcast_quad(xq + i * k_pad + k + 4));        \
                    }                                                                                 \
                }                                                                                     \
            for (int j = 0; j < NB; j++) {                                                            \
                const __m512 sv = _mm512_loadu_ps(cs + (j * groups + g) * LANES);                     \
                const __m512 zv = _mm512_loadu_ps(cz + (j * groups + g) * LANES);                     \
                for (int i = 0; i < MR; i++) {                                                        \
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s[j][i]), sv);                        \
                    f[j][i] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[i * groups + g]), f[j][i]);        \
                    f[j][i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(x_sums[i * groups + g]), f[j][i]);   \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) out[j * MR + i] = f[j][i];                                   \
    }
FOR_EACH_TILE(DEFINE_TILE)

static void int4_tile(int mr, int nb, const quantized_rows *rows, int64_t b, const void *weight, __m512 *out) {
    const int4_weight *q = (const int4_weight *)weight;
    const uint8_t *w = q->w + b * rows->k_pad * 8;
    const float *cs = q->scale + b * rows->groups * LANES, *cz = q->zero + b * rows->groups * LANES;
#define CASE(MR, NB) if (mr == MR && nb == NB) { tile_##MR##_##NB(rows, w, cs, cz, out); return; }
    FOR_EACH_TILE(CASE)
#undef CASE
}

/* y [rows, n_out] (fp32) = x [rows, k_in] (fp32) times the 4-bit weight (the layout above; k_in a
 * multiple of ``group``, itself a multiple of 8).  Returns 0; -1 where its scratch could not be
 * allocated, -2 where the sizes do not fit the layout. */
int int4_vnni_gemm(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale,
                   const float *zero, float *y, int64_t n_out, int64_t group) {
    if (group <= 0 || group % 8 || k_in % group) return -2;
    int4_weight weight = {w, scale, zero};
    const vnni_kernel kernel = VNNI_KERNEL(int4_tile);
    return vnni_product(x, rows, k_in, group, n_out, &kernel, &weight, NULL, y, NULL);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: _mm256_maddubs_epi16 multiplies the unsigned nibbles by the signed activations and adds
 * adjacent pairs into int16 lanes -- channel c's lanes 2c and 2c + 1 -- with no saturation (|pair| <=
 * 2 x 15 x 127 = 3810), so 8 of them (32 inputs) add up in int16 exactly (<= 30480) before
 * _mm256_madd_epi16 by ones widens each channel's two lanes into its int32 sum.  Each group's integer
 * sum is the VNNI kernel's, and the float epilogue is its, in the same order: the same outputs (but
 * for the last bits of the activations' fp32 group sums, which AVX2 adds 8 lanes at a time).  A
 * block's 64 bytes per 8 inputs are two halves of 8 channels (bytes 32h..32h+31: channels 8h..8h+7);
 * a tile takes one half at a time over every input, the second half's bytes then from the cache. */
#include "vnni_rows_avx2.h"

typedef struct {
    const uint8_t *w;
    const float *scale, *zero;
} int4_weight;

static inline __m256i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* MR rows by half h of the block at w (scales and zeros at cs / cz): out[i * LANES + 8 h + c]. */
#define DEFINE_HALF(MR)                                                                               \
    static inline void half_##MR(const quantized_rows *r, const uint8_t *w, const float *cs, const float *cz, \
                                 int h, float *out) {                                                 \
        const int64_t k_pad = r->k_pad, groups = r->groups, group = r->group;                         \
        const int8_t *xq = r->xq;                                                                     \
        const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                   \
        __m256 f[MR];                                                                                 \
        for (int i = 0; i < MR; i++) f[i] = _mm256_setzero_ps();                                      \
        for (int64_t g = 0; g < groups; g++) {                                                        \
            __m256i s[MR];                                                                            \
            for (int i = 0; i < MR; i++) s[i] = _mm256_set1_epi32(-8 * r->sums[i * groups + g]);      \
            for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {                            \
                __m256i a[MR];                                                                        \
                for (int i = 0; i < MR; i++) a[i] = _mm256_setzero_si256();                           \
                for (int64_t k = k0; k < k0 + 32; k += 8) {                                           \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(w + k * 8 + 32 * h));            \
                    __m256i lo = _mm256_and_si256(v, nibble);                                         \
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);                   \
                    for (int i = 0; i < MR; i++) {                                                    \
                        a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(lo, broadcast_quad(xq + i * k_pad + k))); \
                        a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(hi, broadcast_quad(xq + i * k_pad + k + 4))); \
                    }                                                                                 \
                }                                                                                     \
                for (int i = 0; i < MR; i++) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(a[i], ones)); \
            }                                                                                         \
            const __m256 sv = _mm256_loadu_ps(cs + g * LANES + 8 * h);                                \
            const __m256 zv = _mm256_loadu_ps(cz + g * LANES + 8 * h);                                \
            for (int i = 0; i < MR; i++) {                                                            \
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i]), sv);                               \
                f[i] = _mm256_fmadd_ps(t, _mm256_set1_ps(r->xs[i * groups + g]), f[i]);               \
                f[i] = _mm256_fmadd_ps(zv, _mm256_set1_ps(r->x_sums[i * groups + g]), f[i]);          \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < MR; i++) _mm256_storeu_ps(out + i * LANES + 8 * h, f[i]);                 \
    }
DEFINE_HALF(1)
DEFINE_HALF(2)
DEFINE_HALF(3)
DEFINE_HALF(4)

static void int4_tile(int mr, const quantized_rows *rows, int64_t b, const void *weight, float *out) {
    const int4_weight *q = (const int4_weight *)weight;
    const uint8_t *w = q->w + b * rows->k_pad * 8;
    const float *cs = q->scale + b * rows->groups * LANES, *cz = q->zero + b * rows->groups * LANES;
    for (int h = 0; h < 2; h++) switch (mr) {
            case 1: half_1(rows, w, cs, cz, h, out); break;
            case 2: half_2(rows, w, cs, cz, h, out); break;
            case 3: half_3(rows, w, cs, cz, h, out); break;
            default: half_4(rows, w, cs, cz, h, out); break;
        }
}

/* As the VNNI build's int4_vnni_gemm; the group a multiple of 32 (the int16 sums' span). */
int int4_vnni_gemm(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale,
                   const float *zero, float *y, int64_t n_out, int64_t group) {
    if (group <= 0 || group % 32 || k_in % group) return -2;
    int4_weight weight = {w, scale, zero};
    return vnni_product(x, rows, k_in, group, n_out, int4_tile, &weight, NULL, y, NULL);
}
#endif
