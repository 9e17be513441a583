/* int8_vnni_cpu.c's product on AMX tiles (AMX-INT8): the same weight layout, quantized rows and
 * results, bit for bit.
 *
 * Why: at 8 and more rows the AVX512-VNNI tiles are compute-bound on a 2-core machine (one dpbusd,
 * 64 multiply-adds, per row, block and quad of inputs); one TDPBSUD multiplies a tile of up to 16
 * rows by 64 inputs into 16 channels (16 K multiply-adds).
 *
 * The kernel's blocks are AMX's B operand as they lie: a block's quads of inputs are tile rows of 64
 * bytes (16 channels x 4 inputs, unsigned: q + 128), and a group of quantized inputs of up to 16
 * rows is the A tile (signed).  Each group's sums are stored, the +128's share taken back (128 x
 * the group's sum of xq, as the VNNI tile starts from) and scaled into the row's fp32 sums in group
 * order -- the VNNI tile's arithmetic, in its order.  The passes, tiles and shapes: vnni_rows_amx.h.
 * Included by int8_vnni_cpu.c only where the compiler targets AMX-INT8 on Linux. */
#ifndef INT8_AMX_H
#define INT8_AMX_H
#include "vnni_rows_amx.h"

/* One group's stored sums (sums[j][i]: block j, row i) into out[j * mr + i]. */
static inline void int8_scale_group(const quantized_rows *r, int64_t g, int mr, int nb,
                                    int32_t sums[][AMX_ROWS][LANES], __m512 *out, const void *ctx) {
    (void)ctx;
    const int64_t groups = r->groups;
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < mr; i++) {
            __m512i a = _mm512_sub_epi32(_mm512_load_si512((const void *)sums[j][i]),
                                         _mm512_set1_epi32(128 * r->sums[i * groups + g]));
            __m512 scale = _mm512_set1_ps(r->xs[i * groups + g]);
            out[j * mr + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), scale, out[j * mr + i]);
        }
}

/* Group g's inputs k0 .. k0 + group: a block's bytes of input k at w + k * LANES (quads of 16
 * channels), prefetched into L2 AMX_PREFETCH_BYTES ahead. */
#define int8_GROUP_PRODUCTS(C0, C1)                                                                   \
    do {                                                                                              \
        _tile_zero(C0);                                                                               \
        if (nb == 2) _tile_zero(C1);                                                                  \
        for (int64_t k = g * r->group; k < (g + 1) * r->group; k += k_tile) {                         \
            for (int line = 0; line < k_tile * LANES; line += 64) {                                   \
                const int64_t ahead = k * LANES + AMX_PREFETCH_BYTES + line;                          \
                _mm_prefetch((const char *)w0 + ahead, _MM_HINT_T1);                                  \
                if (nb == 2) _mm_prefetch((const char *)w1 + ahead, _MM_HINT_T1);                     \
            }                                                                                         \
            _tile_loadd(0, r->xq + k, r->k_pad);                                                      \
            _tile_loadd(1, w0 + k * LANES, 64);                                                       \
            _tile_dpbsud(C0, 0, 1);                                                                   \
            if (nb == 2) {                                                                            \
                _tile_loadd(2, w1 + k * LANES, 64);                                                   \
                _tile_dpbsud(C1, 0, 2);                                                               \
            }                                                                                         \
        }                                                                                             \
        _tile_stored(C0, sums[0], LANES * 4);                                                         \
        if (nb == 2) _tile_stored(C1, sums[1], LANES * 4);                                            \
    } while (0)

/* mr (<= 16) rows by nb (<= 2) blocks from block b: out[j * mr + i], as int8_tile computes them. */
static void amx_int8_tile(int mr, int nb, const quantized_rows *r, int64_t b, const void *weight, __m512 *out) {
    const uint8_t *w0 = (const uint8_t *)weight + b * r->k_pad * LANES, *w1 = w0 + r->k_pad * LANES;
    const int64_t k_tile = amx_k_tile(r->group);
    const void *ctx = NULL;
    AMX_GROUPS(int8, r, mr, nb, out);
}
#undef int8_GROUP_PRODUCTS

static const vnni_kernel AMX_INT8 = {amx_int8_tile, AMX_ROWS, AMX_BLOCKS, amx_begin_pass, amx_finish};
#endif
