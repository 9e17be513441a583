/* y[m, n] = scale[n] * sum_g xs[m, g] * sum_{k in g} xq[m, k] * q[n, k]: an int8 weight (per output
 * channel scales) times activations quantized to int8 on the fly, in groups of ``group`` inputs
 * (one scale per row and group), on CPUs with AVX512-VNNI -- or, a second build of the same layout
 * and the same sums, with AVX2 and FMA (below).
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
 * The activations' quantization and the threads' split of the blocks: vnni_rows.h.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "vnni_rows.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "int8_amx.h"
#define AMX 1
#endif

/* MR rows by NB consecutive blocks (block j's bytes at w + j * k_pad * LANES): out[j * MR + i]. */
#define DEFINE_TILE(MR, NB)                                                                           \
    static inline void tile_##MR##_##NB(const quantized_rows *r, const uint8_t *w, __m512 *out) {     \
        const int64_t k_pad = r->k_pad, groups = r->groups, group = r->group;                         \
        const int8_t *xq = r->xq;                                                                     \
        const float *xs = r->xs;                                                                      \
        const int32_t *sums = r->sums;                                                                \
        __m512 f[NB][MR];                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) f[j][i] = _mm512_setzero_ps();                               \
        for (int64_t g = 0; g < groups; g++) {                                                        \
            int64_t k0 = g * group, k1 = k0 + group < k_pad ? k0 + group : k_pad;                        \
            __m512i a[NB][MR];                                                                        \
            for (int j = 0; j < NB; j++) /* the +128's share: 128 x the group's sum of inputs */      \
                for (int i = 0; i < MR; i++) a[j][i] = _mm512_set1_epi32(-128 * sums[i * groups + g]); \
            for (int64_t k = k0; k < k1; k += 4)                                                      \
                for (int j = 0; j < NB; j++) {                                                        \
                    PREFETCH_WEIGHT(MR, w + j * k_pad * LANES + k * LANES);                           \
                    __m512i wv = _mm512_loadu_si512((const void *)(w + j * k_pad * LANES + k * LANES)); \
                    for (int i = 0; i < MR; i++)                                                      \
                        a[j][i] = dpbusd(a[j][i], wv, broadcast_quad(xq + i * k_pad + k));            \
                }                                                                                     \
            for (int i = 0; i < MR; i++) {                                                            \
                __m512 s = _mm512_set1_ps(xs[i * groups + g]);                                        \
                for (int j = 0; j < NB; j++) f[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j][i]), s, f[j][i]); \
            }                                                                                         \
        }                                                                                             \
        for (int j = 0; j < NB; j++)                                                                  \
            for (int i = 0; i < MR; i++) out[j * MR + i] = f[j][i];                                   \
    }
FOR_EACH_TILE(DEFINE_TILE)
FOR_EACH_WIDE_TILE(DEFINE_TILE)

static void int8_tile(int mr, int nb, const quantized_rows *rows, int64_t b, const void *weight, __m512 *out) {
    const uint8_t *w = (const uint8_t *)weight + b * rows->k_pad * LANES;
#define CASE(MR, NB) if (mr == MR && nb == NB) { tile_##MR##_##NB(rows, w, out); return; }
    FOR_EACH_TILE(CASE)
    FOR_EACH_WIDE_TILE(CASE)
#undef CASE
}

static const vnni_kernel VNNI_INT8 = VNNI_KERNEL(int8_tile);
static const vnni_kernel VNNI_INT8_WIDE = VNNI_WIDE_KERNEL(int8_tile);
static int products_with_amx = 1;

/* Which tiles a product of ``rows`` rows of k_in inputs in groups of ``group`` runs on: AMX where
 * the CPU has them, Linux grants them, they are allowed, the shape fits (int8_amx.h) and the rows are
 * AMX_MIN_ROWS or more, else the VNNI ones (two blocks a pass from VNNI_WIDE_MIN_ROWS rows). */
static const vnni_kernel *int8_kernel(int64_t rows, int64_t k_in, int64_t group) {
#ifdef AMX
    if (products_with_amx && amx_fits(rows, k_in, group)) return &AMX_INT8;
#endif
    (void)k_in, (void)group;
    return rows >= VNNI_WIDE_MIN_ROWS ? &VNNI_INT8_WIDE : &VNNI_INT8;
}

/* Which tiles the products run on from now on in this process: 2 AMX (where the CPU has them and
 * Linux grants them), 1 AVX512-VNNI; ``allow_amx`` 0 keeps AMX out (tests compare the two). */
int int8_vnni_path(int allow_amx) {
    products_with_amx = allow_amx != 0;
#ifdef AMX
    if (products_with_amx && amx_permitted()) return 2;
#endif
    return 1;
}

/* y [rows, n_out] (fp32) = x [rows, k_in] (fp32) times the weight w (the layout above, k_pad = k_in
 * rounded up to 4) with per-channel ``scale``; activations quantized in groups of ``group`` inputs (a
 * multiple of 4).  Returns 0; -1 where its scratch could not be allocated, -2 for another group. */
int int8_vnni_gemm(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale, float *y,
                   int64_t n_out, int64_t group) {
    if (group <= 0 || group % 4) return -2;
    return vnni_product(x, rows, k_in, group, n_out, int8_kernel(rows, k_in, group), w, scale, y, NULL);
}

/* tokens[row] = the first index of row's largest output of int8_vnni_gemm (an LM head's greedy
 * tokens without its logits: no n_out floats a row written and read back).  Returns 0; 1 where an
 * output was not finite (tokens unset: the caller takes the logits); -1 / -2 as int8_vnni_gemm. */
int int8_vnni_argmax(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale,
                     int64_t n_out, int64_t group, int64_t *tokens) {
    if (group <= 0 || group % 4) return -2;
    return vnni_product(x, rows, k_in, group, n_out, int8_kernel(rows, k_in, group), w, scale, NULL, tokens);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has no byte dot product into int32 lanes: _mm256_maddubs_epi16 multiplies unsigned bytes by
 * signed ones and adds adjacent pairs into int16 lanes, and _mm256_madd_epi16 by ones widens each
 * channel's two pairs into its int32 sum of the quad.  The stored q + 128 overflows those pairs
 * (255 x 127 x 2 > 32767), so a tile takes q itself (the byte's top bit flipped) and its magnitude
 * as the unsigned side, and moves q's sign onto the activation (_mm256_sign_epi8: x negated where
 * q < 0, zero where q = 0): |q| x sign(q) x = q x, each pair within 2 x 127 x 127 = 32258 (q and the
 * activations are within +-127).  So each group's integer sum is the VNNI kernel's exactly, and the
 * float epilogue is its, in the same order: the same outputs bit for bit.
 *
 * Why: the fp32-sum kernel (int8_gemv_cpu.c) widens every weight to fp32 (three instructions per 8
 * weights before the FMAs), so even a one-row product, which should be bound by reading a quarter of
 * fp32's bytes, ran at its instructions' rate.  Here a row's 32 multiply-adds are four instructions
 * past the shared loads (sign, maddubs, madd, add), with no widening; the weight is the VNNI build's
 * layout, so a prefill chunk takes it too rather than the dequantized weight.  On a Zen 1 (its integer
 * multiplies on one pipe, 128-bit FMAs on two) the int8 LM head's greedy tokens at 1 / 2 / 8 rows went
 * 20.3 / 19.7 / 54.2 -> 13.2 / 14.5 / 52.2 ms: from 4 rows on both are compute-bound at about the rate
 * fp32's FMAs give.  A block's 64 bytes per quad are two halves of 8 channels (bytes 32 h .. 32 h + 31:
 * channels 8 h .. 8 h + 7). */
#include "vnni_rows_avx2.h"

static inline __m256i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* MR rows by the block at w: out[i * LANES + c], the group-scaled sums (the channels' scales are the
 * driver's). */
#define DEFINE_TILE(MR)                                                                               \
    static inline void tile_##MR(const quantized_rows *r, const uint8_t *w, float *out) {             \
        const int64_t k_pad = r->k_pad, groups = r->groups, group = r->group;                         \
        const int8_t *xq = r->xq;                                                                     \
        const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);               \
        __m256 f[2][MR];                                                                              \
        for (int h = 0; h < 2; h++)                                                                   \
            for (int i = 0; i < MR; i++) f[h][i] = _mm256_setzero_ps();                               \
        for (int64_t g = 0; g < groups; g++) {                                                        \
            int64_t k0 = g * group, k1 = k0 + group < k_pad ? k0 + group : k_pad;                        \
            __m256i a[2][MR];                                                                         \
            for (int h = 0; h < 2; h++)                                                               \
                for (int i = 0; i < MR; i++) a[h][i] = _mm256_setzero_si256();                        \
            for (int64_t k = k0; k < k1; k += 4) {                                                    \
                const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + k * LANES)), flip); \
                const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + k * LANES + 32)), flip); \
                const __m256i m0 = _mm256_abs_epi8(q0), m1 = _mm256_abs_epi8(q1);                     \
                for (int i = 0; i < MR; i++) {                                                        \
                    const __m256i x = broadcast_quad(xq + i * k_pad + k);                             \
                    a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(x, q0)), ones)); \
                    a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(x, q1)), ones)); \
                }                                                                                     \
            }                                                                                         \
            for (int i = 0; i < MR; i++) {                                                            \
                const __m256 s = _mm256_set1_ps(r->xs[i * groups + g]);                               \
                for (int h = 0; h < 2; h++) f[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][i]), s, f[h][i]); \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < MR; i++)                                                                  \
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + i * LANES + 8 * h, f[h][i]);           \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)

static void int8_tile(int mr, const quantized_rows *rows, int64_t b, const void *weight, float *out) {
    const uint8_t *w = (const uint8_t *)weight + b * rows->k_pad * LANES;
    switch (mr) {
        case 1: tile_1(rows, w, out); break;
        case 2: tile_2(rows, w, out); break;
        case 3: tile_3(rows, w, out); break;
        default: tile_4(rows, w, out); break;
    }
}

/* 3: this build's tiles (as the AVX-512 build's int8_vnni_path; ``allow_amx`` has nothing to keep out). */
int int8_vnni_path(int allow_amx) {
    (void)allow_amx;
    return 3;
}

/* As the AVX-512 build's. */
int int8_vnni_gemm(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale, float *y,
                   int64_t n_out, int64_t group) {
    if (group <= 0 || group % 4) return -2;
    return vnni_product(x, rows, k_in, group, n_out, int8_tile, w, scale, y, NULL);
}

int int8_vnni_argmax(const float *x, int64_t rows, int64_t k_in, const uint8_t *w, const float *scale,
                     int64_t n_out, int64_t group, int64_t *tokens) {
    if (group <= 0 || group % 4) return -2;
    return vnni_product(x, rows, k_in, group, n_out, int8_tile, w, scale, NULL, tokens);
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && defined(__FMA__))
/* out [n, in] (fp32) = rows ids[0 .. n) of the weight w (the layout above, k_pad = in rounded up to 4),
 * each value times its row's scale: a tied LM head's embedding lookup, one fp32 product a value as
 * torch computes (q.float() * scale[id]).  Returns 0; -2 for an id outside [0, n_out). */
int int8_vnni_rows(const uint8_t *w, const float *scale, int64_t n_out, int64_t in, const int64_t *ids, int64_t n,
                   float *out) {
    const int64_t k_pad = (in + 3) & ~(int64_t)3;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_out) return -2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i], block = id / LANES, lane = id % LANES;
        const float s = scale[id];
        const uint8_t *row = w + block * k_pad * LANES + lane * 4; /* quad k / 4 at + (k / 4) * LANES * 4 */
        float *o = out + i * in;
        for (int64_t k = 0; k < in; k++) o[k] = (float)(int8_t)(row[(k / 4) * LANES * 4 + k % 4] ^ 0x80) * s;
    }
    return 0;
}

#endif
