/* int8_vnni_cpu.c's product on AMX tiles (AMX-INT8): the same weight layout, quantized rows and
 * results, bit for bit.
 *
 * Why: at 8 and more rows the AVX512-VNNI tiles are compute-bound on a 2-core machine (one dpbusd,
 * 64 multiply-adds, per row, block and quad of inputs); one TDPBSUD multiplies a tile of up to 16
 * rows by 64 inputs into 16 channels (16 K multiply-adds).
 *
 * The kernel's blocks are AMX's B operand as they lie: a block's 16 quads of inputs g * 64 .. are
 * 16 tile rows of 64 bytes (16 channels x 4 inputs, unsigned: q + 128), and a group of 64 quantized
 * inputs of up to 16 rows is the A tile (signed).  TDPBSUD sums each group exactly in int32, so a
 * group is a tile product of its own: its sums are stored, the +128's share taken back (128 x the
 * group's sum of xq, as the VNNI tile starts from) and scaled into the row's fp32 sums in group
 * order -- the VNNI tile's arithmetic, in its order.  Two blocks a pass share the A tile; the
 * groups alternate between two pairs of accumulator tiles, so a group's tile products run while the
 * one before is scaled.  Only for groups of 64 and a multiple of 64 inputs (a tile row past the
 * inputs would read the next block); other shapes take the VNNI tiles.
 *
 * Tiles: 0 the rows' group (mr x 64 bytes), 1 and 2 the blocks' group (16 x 64), 4 / 5 and 6 / 7
 * the blocks' sums (mr x 16 int32) of even and odd groups.  Included by int8_vnni_cpu.c only where
 * the compiler targets AMX-INT8 on Linux. */
#ifndef INT8_AMX_H
#define INT8_AMX_H
#include "amx.h"

#define AMX_ROWS 16  /* rows a pass: a tile's rows */
#define AMX_BLOCKS 2 /* blocks a pass */
#define AMX_GROUP 64 /* inputs a tile product: a tile row's bytes */
#define AMX_PREFETCH_BYTES 4096 /* weight bytes ahead of each block's tile loads */
/* Fewer rows take the VNNI tiles: a product alone, two builds interleaved on a Sapphire Rapids-class
 * VM, AMX against VNNI: 1-2 rows 0.76-0.97x, 4 rows 0.96-1.09x, 6 rows 1.11-1.20x, 8 rows 1.19-1.33x,
 * 16 rows 1.37-1.65x, 64 rows 1.55-1.68x (the layers' shapes; the LM head's, which streams its
 * weight from memory, 1.0-1.25x up to 16 rows, 1.39x at 64). */
#define AMX_MIN_ROWS 5

static __thread int amx_rows_configured; /* the rows this thread's tiles are set up for; 0 none */

static void amx_begin_pass(int mr) {
    if (amx_rows_configured == mr) return;
    const uint8_t rows[8] = {(uint8_t)mr, 16, 16, 0, (uint8_t)mr, (uint8_t)mr, (uint8_t)mr, (uint8_t)mr};
    const uint16_t colsb[8] = {64, 64, 64, 0, 64, 64, 64, 64};
    amx_load_config(8, rows, colsb);
    amx_rows_configured = mr;
}

static void amx_finish(void) {
    if (!amx_rows_configured) return;
    _tile_release();
    amx_rows_configured = 0;
}

/* One group's stored sums (sums[j][i]: block j, row i) into out[j * mr + i]. */
static inline void amx_scale_group(const quantized_rows *r, int64_t g, int mr, int nb, int32_t sums[][AMX_ROWS][LANES],
                                   __m512 *out) {
    const int64_t groups = r->groups;
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < mr; i++) {
            __m512i a = _mm512_sub_epi32(_mm512_load_si512((const void *)sums[j][i]),
                                         _mm512_set1_epi32(128 * r->sums[i * groups + g]));
            out[j * mr + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(r->xs[i * groups + g]), out[j * mr + i]);
        }
}

/* Group g's tile products of blocks w0 (and w1 where nb is 2) into the accumulator pair C0 / C1,
 * stored into sums. */
#define AMX_GROUP_PRODUCTS(C0, C1)                                                                    \
    do {                                                                                              \
        _tile_loadd(0, r->xq + g * AMX_GROUP, r->k_pad);                                              \
        for (int line = 0; line < AMX_GROUP * LANES; line += 64) {                                    \
            _mm_prefetch((const char *)w0 + (g * AMX_GROUP * LANES + AMX_PREFETCH_BYTES + line), _MM_HINT_T0); \
            if (nb == 2)                                                                              \
                _mm_prefetch((const char *)w1 + (g * AMX_GROUP * LANES + AMX_PREFETCH_BYTES + line), _MM_HINT_T0); \
        }                                                                                             \
        _tile_zero(C0);                                                                               \
        _tile_loadd(1, w0 + g * AMX_GROUP * LANES, AMX_GROUP);                                        \
        _tile_dpbsud(C0, 0, 1);                                                                       \
        if (nb == 2) {                                                                                \
            _tile_zero(C1);                                                                           \
            _tile_loadd(2, w1 + g * AMX_GROUP * LANES, AMX_GROUP);                                    \
            _tile_dpbsud(C1, 0, 2);                                                                   \
        }                                                                                             \
        _tile_stored(C0, sums[0], LANES * 4);                                                         \
        if (nb == 2) _tile_stored(C1, sums[1], LANES * 4);                                            \
    } while (0)

/* mr (<= 16) rows by nb (<= 2) blocks from block b: out[j * mr + i], as int8_tile computes them. */
static void amx_int8_tile(int mr, int nb, const quantized_rows *r, int64_t b, const void *weight, __m512 *out) {
    const uint8_t *w0 = (const uint8_t *)weight + b * r->k_pad * LANES, *w1 = w0 + r->k_pad * LANES;
    int32_t even[AMX_BLOCKS][AMX_ROWS][LANES] __attribute__((aligned(64)));
    int32_t odd[AMX_BLOCKS][AMX_ROWS][LANES] __attribute__((aligned(64)));
    for (int i = 0; i < nb * mr; i++) out[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < r->groups; g++) {
        if (g % 2 == 0) {
            int32_t(*sums)[AMX_ROWS][LANES] = even;
            AMX_GROUP_PRODUCTS(4, 5);
            if (g > 0) amx_scale_group(r, g - 1, mr, nb, odd, out);
        } else {
            int32_t(*sums)[AMX_ROWS][LANES] = odd;
            AMX_GROUP_PRODUCTS(6, 7);
            amx_scale_group(r, g - 1, mr, nb, even, out);
        }
    }
    amx_scale_group(r, r->groups - 1, mr, nb, (r->groups - 1) % 2 ? odd : even, out);
}
#undef AMX_GROUP_PRODUCTS

static const vnni_kernel AMX_INT8 = {amx_int8_tile, AMX_ROWS, AMX_BLOCKS, amx_begin_pass, amx_finish};
#endif
