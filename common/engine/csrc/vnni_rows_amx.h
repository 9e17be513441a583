/* The AMX products' passes (int8_amx.h): their tiles' configuration on each thread, the rows and
 * blocks of a pass, and when they apply.  The 4-bit weights stay on the VNNI tiles: unpacked into
 * tile rows (a buffer the B tile loads, one tile product ahead), with int4's groups of 32 inputs a
 * tile product of half a tile row each, they measured 0.92-1.20x the VNNI tiles' products at 8-64
 * rows and no faster in a decode-bound or a 64-request run.
 *
 * A pass is up to 16 rows by 2 blocks of 16 output channels.  Tiles: 0 the rows' quantized inputs
 * (mr rows of k_tile bytes, signed), 1 and 2 the two blocks' weights (k_tile / 4 rows of 16 channels
 * x 4 inputs, unsigned), 4 / 5 and 6 / 7 the blocks' int32 sums (mr x 16) of even and odd groups:
 * TDPBSUD sums a group exactly, so each group is tile products of its own, stored and scaled while
 * the next group's run.  k_tile is the activations' group, at most 64 (a tile row's bytes); a larger
 * group is several products into its sums.  Included only where the compiler targets AMX-INT8 on
 * Linux, after vnni_rows.h. */
#ifndef VNNI_ROWS_AMX_H
#define VNNI_ROWS_AMX_H
#include "amx.h"

#define AMX_ROWS 16   /* rows a pass: a tile's rows */
#define AMX_BLOCKS 2  /* blocks a pass */
#define AMX_K_MAX 64  /* inputs a tile product, at most: a tile row's bytes */
/* Weight bytes ahead of each block's tile loads that are prefetched into L2: the LM head's greedy
 * tokens at 8 rows, builds side by side on a Sapphire Rapids-class VM, 4 KB into L1 7.1-8.3 ms, 16 KB
 * into L2 6.1-6.6 ms; the decode-bound workload (quantized.py --quick, int8, interleaved in one
 * engine) 353 -> 371 tok/s, the 64-request one within its noise (+1-2%). */
#define AMX_PREFETCH_BYTES 16384
/* Fewer rows take the VNNI tiles: int8 products alone, two builds interleaved on a Sapphire
 * Rapids-class VM, AMX against VNNI: 1-2 rows 0.76-0.97x, 4 rows 0.96-1.09x, 6 rows 1.11-1.20x,
 * 8 rows 1.19-1.33x, 16 rows 1.37-1.65x, 64 rows 1.55-1.68x (the layers' shapes; the LM head's,
 * which streams its weight from memory, 1.0-1.25x up to 16 rows, 1.39x at 64). */
#define AMX_MIN_ROWS 5

static __thread int amx_rows_configured;   /* the rows this thread's tiles are set up for; 0 none */
static __thread int amx_k_tile_configured; /* and the inputs a tile product */

static inline int amx_k_tile(int64_t group) { return group < AMX_K_MAX ? (int)group : AMX_K_MAX; }

/* Whether a product of ``rows`` rows, k_in inputs in groups of ``group`` fits the tiles: groups of
 * 16, 32 or 64 inputs or a multiple of 64 (a tile row past a group would read the next one's). */
static inline int amx_fits(int64_t rows, int64_t k_in, int64_t group) {
    int64_t k_tile = amx_k_tile(group);
    return rows >= AMX_MIN_ROWS && group > 0 && (k_tile == 16 || k_tile == 32 || k_tile == 64) &&
           group % k_tile == 0 && k_in % group == 0 && amx_permitted();
}

static void amx_begin_pass(int mr, int64_t group) {
    const int k_tile = amx_k_tile(group);
    if (amx_rows_configured == mr && amx_k_tile_configured == k_tile) return;
    const uint8_t m = (uint8_t)mr, b = (uint8_t)(k_tile / 4);
    const uint8_t rows[8] = {m, b, b, 0, m, m, m, m};
    const uint16_t colsb[8] = {(uint16_t)k_tile, 64, 64, 0, 64, 64, 64, 64};
    amx_load_config(8, rows, colsb);
    amx_rows_configured = mr;
    amx_k_tile_configured = k_tile;
}

static void amx_finish(void) {
    if (!amx_rows_configured) return;
    _tile_release();
    amx_rows_configured = amx_k_tile_configured = 0;
}

/* A kernel K's tile over the groups of rows r: group g's sums of the pass's blocks into
 * the tile pair C0 / C1 and then into ``sums`` by K##_GROUP_PRODUCTS(C0, C1) (the kernel's macro,
 * reading r, g, nb, sums and its own locals), the groups alternating between the pairs 4 / 5 and
 * 6 / 7, each scaled into out by K##_scale_group(r, g, mr, nb, sums, out, ctx) while the next one's
 * products run. */
#define AMX_GROUPS(K, r, mr, nb, out)                                                                 \
    do {                                                                                              \
        int32_t even[AMX_BLOCKS][AMX_ROWS][LANES] __attribute__((aligned(64)));                       \
        int32_t odd[AMX_BLOCKS][AMX_ROWS][LANES] __attribute__((aligned(64)));                        \
        for (int i = 0; i < (nb) * (mr); i++) (out)[i] = _mm512_setzero_ps();                         \
        for (int64_t g = 0; g < (r)->groups; g++) {                                                   \
            if (g % 2 == 0) {                                                                         \
                int32_t(*sums)[AMX_ROWS][LANES] = even;                                               \
                K##_GROUP_PRODUCTS(4, 5);                                                             \
                if (g > 0) K##_scale_group(r, g - 1, mr, nb, odd, out, ctx);                    \
            } else {                                                                                  \
                int32_t(*sums)[AMX_ROWS][LANES] = odd;                                                \
                K##_GROUP_PRODUCTS(6, 7);                                                             \
                K##_scale_group(r, g - 1, mr, nb, even, out, ctx);                              \
            }                                                                                         \
        }                                                                                             \
        K##_scale_group(r, (r)->groups - 1, mr, nb, ((r)->groups - 1) % 2 ? odd : even, out, ctx); \
    } while (0)
#endif
