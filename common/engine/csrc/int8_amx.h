/* int8_vnni_cpu.c's product on AMX tiles (AMX-INT8): the same weight layout, quantized rows and
 * results, bit for bit.
 *
 * Why: at 8 and more rows the AVX512-VNNI tiles are compute-bound on a 2-core machine (one dpbusd,
 * 64 multiply-adds, per row, block and quad of inputs); one TDPBSUD multiplies a tile of up to 16
 * rows by 64 inputs into 16 channels (16 K multiply-adds).
 *
 * The kernel's blocks are AMX's B operand as they lie: a block's quads of inputs are tile rows of 64
 * bytes (16 channels x 4 inputs, unsigned: q + 128), and a group of quantized inputs of up to 16
 * rows is the A tile (signed).  TDPBSUD sums a group exactly in int32, so each group is tile
 * products of its own: its sums are stored, the +128's share taken back (128 x the group's sum of
 * xq, as the VNNI tile starts from) and scaled into the row's fp32 sums in group order -- the VNNI
 * tile's arithmetic, in its order.
 *
 * A pass is up to 32 rows by 2 blocks of 16 output channels, four tile products a step (two row
 * tiles by two weight tiles: each tile load feeds two products).  Tiles: 0 / 1 the rows' inputs
 * (rows 0-15 and 16-31, k_tile bytes each), 2 / 3 the two blocks' weights (k_tile / 4 rows of 16
 * channels x 4 inputs), 4 + 2a + j the int32 sums (up to 16 x 16) of row tile a and block j.  A
 * group's sums are stored to one of two buffers and scaled while the next group's products run (the
 * scaling sits between them in program order).  k_tile is the activations' group, at most 64 (a tile
 * row's bytes); a larger group is several products into its sums.  Against passes of 16 rows with the
 * sums' tiles double-buffered instead (the products alone, the layers' four shapes, two builds
 * interleaved on a Xeon with AMX): 17 / 31 rows 1.27 / 1.16x, 64 rows 1.08x, 512 rows 1.06x.
 *
 * The 4-bit weights stay on the VNNI tiles: unpacked into tile rows (a buffer the B tile loads, one
 * tile product ahead), with int4's groups of 32 inputs a tile product of half a tile row each, they
 * measured 0.92-1.20x the VNNI tiles' products at 8-64 rows and no faster in a decode-bound or a
 * 64-request run.  Included by int8_vnni_cpu.c only where the compiler targets AMX-INT8 on Linux. */
#ifndef INT8_AMX_H
#define INT8_AMX_H
#include "amx.h"

#define AMX_ROWS 32      /* rows a pass: two row tiles */
#define AMX_TILE_ROWS 16 /* a tile's rows */
#define AMX_BLOCKS 2  /* blocks a pass */
#define AMX_K_MAX 64  /* inputs a tile product, at most: a tile row's bytes */
/* The weight bytes ahead of each block's tile loads are prefetched as the VNNI tiles do on AMX CPUs
 * (vnni_rows.h's PREFETCH_BYTES into PREFETCH_HINT: 16 KB into L2): the LM head's greedy tokens at 8
 * rows, builds side by side on a Sapphire Rapids-class VM, 4 KB into L1 7.1-8.3 ms, 16 KB into L2
 * 6.1-6.6 ms; the decode-bound workload (quantized.py --quick, int8, interleaved in one engine) 353
 * -> 371 tok/s, the 64-request one within its noise (+1-2%).  Only in a row block's first pass over
 * its chunk of blocks (quantized_rows.first_pass): the passes after it find those bytes cached, and
 * the prefetches (32 instructions a tile product of 64 inputs) cost them time -- alone, 2 threads, a
 * Xeon with AMX (Granite Rapids-class VM), two runs each: 64 x 640 x 4096 0.216-0.224 -> 0.187-0.196
 * ms, 2048 x 2048 x 640 3.65-3.72 -> 3.49-3.55 ms, 2048 x 640 x 4096 6.59-6.63 -> 6.34-6.53 ms, the
 * LM head's 64 rows 16.0-16.5 -> 15.5-16.2 ms (32 rows, one pass: the same). */
/* Fewer rows take the VNNI tiles: products alone, two builds interleaved on a Sapphire Rapids-class
 * VM, AMX against VNNI: 1-2 rows 0.76-0.97x, 4 rows 0.96-1.09x, 6 rows 1.11-1.20x, 8 rows
 * 1.19-1.33x, 16 rows 1.37-1.65x, 64 rows 1.55-1.68x (the layers' shapes; the LM head's, which
 * streams its weight from memory, 1.0-1.25x up to 16 rows, 1.39x at 64). */
#define AMX_MIN_ROWS 5

static __thread int amx_rows_configured;   /* the rows this thread's tiles are set up for; 0 none */
static __thread int amx_k_tile_configured; /* and the inputs a tile product */

static inline int amx_k_tile(int64_t group) { return group < AMX_K_MAX ? (int)group : AMX_K_MAX; }

/* Whether a product of ``rows`` rows, k_in inputs in groups of ``group`` fits the tiles: groups of
 * 16, 32 or 64 inputs or a multiple of 64, and inputs a multiple of the tile products' (a tile row
 * past the inputs would read the next block's; the last group may be shorter, as on VNNI). */
static inline int amx_fits(int64_t rows, int64_t k_in, int64_t group) {
    int64_t k_tile = amx_k_tile(group);
    return rows >= AMX_MIN_ROWS && group > 0 && (k_tile == 16 || k_tile == 32 || k_tile == 64) &&
           group % k_tile == 0 && k_in % k_tile == 0 && amx_permitted();
}

/* The tiles for passes of mr rows (a second row tile, and its sums, only past 16 rows). */
static void amx_begin_pass(int mr, int64_t group) {
    const int k_tile = amx_k_tile(group);
    if (amx_rows_configured == mr && amx_k_tile_configured == k_tile) return;
    const uint8_t m0 = (uint8_t)(mr < AMX_TILE_ROWS ? mr : AMX_TILE_ROWS), m1 = (uint8_t)(mr - m0);
    const uint8_t b = (uint8_t)(k_tile / 4);
    const uint8_t rows[8] = {m0, m1, b, b, m0, m0, m1, m1};
    const uint16_t colsb[8] = {(uint16_t)k_tile, m1 ? (uint16_t)k_tile : 0, 64, 64, 64, 64, m1 ? 64 : 0, m1 ? 64 : 0};
    amx_load_config(8, rows, colsb);
    amx_rows_configured = mr;
    amx_k_tile_configured = k_tile;
}

static void amx_finish(void) {
    if (!amx_rows_configured) return;
    _tile_release();
    amx_rows_configured = amx_k_tile_configured = 0;
}

/* One group's stored sums (sums[j][i]: block j, row i of the pass) into out[j * mr + i]. */
static inline __attribute__((always_inline)) void amx_scale_rows(const quantized_rows *r, int64_t g, const int mr,
                                                                 const int nb, int32_t sums[][AMX_ROWS][LANES],
                                                                 __m512 *out) {
    const int64_t groups = r->groups;
    for (int i = 0; i < mr; i++) {
        const __m512i offset = _mm512_set1_epi32(128 * r->sums[i * groups + g]);
        const __m512 scale = _mm512_set1_ps(r->xs[i * groups + g]);
        for (int j = 0; j < nb; j++) {
            __m512i a = _mm512_sub_epi32(_mm512_load_si512((const void *)sums[j][i]), offset);
            /* the first group onto zero here rather than out zeroed first (GCC made that a memset) */
            out[j * mr + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), scale, g ? out[j * mr + i] : _mm512_setzero_ps());
        }
    }
}

/* amx_scale_rows with a whole pass's shape (32 rows by 2 blocks) known to the compiler, its loops
 * unrolled; any other shape by the general loops.  Alone, 2 threads, a Xeon with AMX, against the
 * shape a variable: the LM head's 64 rows 20.9 -> 18.1 ms, 2048 x 640 x 4096 7.49 -> 7.30 ms, 64 x 640
 * x 4096 within the noise (0.21-0.23 ms). */
static void amx_scale_group(const quantized_rows *r, int64_t g, int mr, int nb, int32_t sums[][AMX_ROWS][LANES],
                            __m512 *out) {
    if (mr == AMX_ROWS && nb == AMX_BLOCKS)
        amx_scale_rows(r, g, AMX_ROWS, AMX_BLOCKS, sums, out);
    else
        amx_scale_rows(r, g, mr, nb, sums, out);
}

/* mr (<= 32) rows by nb (<= 2) blocks from block b: out[j * mr + i], as int8_tile computes them. */
static void amx_int8_tile(int mr, int nb, const quantized_rows *r, int64_t b, const void *weight, __m512 *out) {
    const uint8_t *w0 = (const uint8_t *)weight + b * r->k_pad * LANES, *w1 = w0 + r->k_pad * LANES;
    const int64_t k_tile = amx_k_tile(r->group), k_pad = r->k_pad;
    const int two = mr > AMX_TILE_ROWS;
    const int8_t *x1 = r->xq + AMX_TILE_ROWS * k_pad;
    int32_t sums[2][AMX_BLOCKS][AMX_ROWS][LANES] __attribute__((aligned(64)));
    for (int64_t g = 0; g <= r->groups; g++) {
        int32_t (*now)[AMX_ROWS][LANES] = sums[g % 2];
        if (g < r->groups) {
            _tile_zero(4);
            if (nb == 2) _tile_zero(5);
            if (two) {
                _tile_zero(6);
                if (nb == 2) _tile_zero(7);
            }
            const int64_t k_end = (g + 1) * r->group < k_pad ? (g + 1) * r->group : k_pad;
            for (int64_t k = g * r->group; k < k_end; k += k_tile) {
                for (int line = 0; r->first_pass && line < k_tile * LANES; line += 64) {
                    const int64_t ahead = k * LANES + PREFETCH_BYTES + line;
                    _mm_prefetch((const char *)w0 + ahead, PREFETCH_HINT);
                    if (nb == 2) _mm_prefetch((const char *)w1 + ahead, PREFETCH_HINT);
                }
                _tile_loadd(0, r->xq + k, k_pad);
                _tile_loadd(2, w0 + k * LANES, 64);
                _tile_dpbsud(4, 0, 2);
                if (two) {
                    _tile_loadd(1, x1 + k, k_pad);
                    _tile_dpbsud(6, 1, 2);
                }
                if (nb == 2) {
                    _tile_loadd(3, w1 + k * LANES, 64);
                    _tile_dpbsud(5, 0, 3);
                    if (two) _tile_dpbsud(7, 1, 3);
                }
            }
        }
        if (g > 0) amx_scale_group(r, g - 1, mr, nb, sums[(g - 1) % 2], out);
        if (g < r->groups) {
            _tile_stored(4, now[0][0], LANES * 4);
            if (nb == 2) _tile_stored(5, now[1][0], LANES * 4);
            if (two) {
                _tile_stored(6, now[0][AMX_TILE_ROWS], LANES * 4);
                if (nb == 2) _tile_stored(7, now[1][AMX_TILE_ROWS], LANES * 4);
            }
        }
    }
}

static const vnni_kernel AMX_INT8 = {amx_int8_tile, AMX_ROWS, AMX_BLOCKS, amx_begin_pass, amx_finish};
#endif
