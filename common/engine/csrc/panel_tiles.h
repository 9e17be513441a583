/* The AVX-512 tiling both panel kernels use (panel_gemm_cpu.c's fp32 panels, bf16_panel_cpu.c's bf16
 * ones): products of up to SMALL_ROWS rows take groups of SMALL_PANELS panels (enough independent
 * chains to hide the multiply-add latency with few rows), more rows groups of LARGE_PANELS panels by
 * tiles of up to LARGE_ROWS rows (as many rows a pass over the weights as the registers allow), the
 * last, partial group one panel at a time by up to EDGE_ROWS rows.  4 panels x 4 rows: 16
 * accumulators; 2 x 12: 24 and two panel vectors, 26 of AVX-512's 32 registers; 1 x 16.  One panel
 * by 16 rows streamed the weights slower, and tiles of 8 rows passed over them more often (Sapphire
 * Rapids, the fp32 LM head at 16 rows 40 / 35.5 / 32.9 ms).
 *
 * A kernel defines its tile_<R>_<P> functions with AVX512_PANEL_TILES(its macro), then the tables
 * with AVX512_PANEL_TILE_TABLES(its tile function type). */
#ifndef PANEL_TILES_H
#define PANEL_TILES_H

#define SMALL_ROWS 4
#define LARGE_ROWS 12
#define EDGE_ROWS 16
#define AVX512_PANEL_TILES(X)                                                                                \
    X(1, 4) X(2, 4) X(3, 4) X(4, 4)                                                                          \
    X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(6, 2) X(7, 2) X(8, 2) X(9, 2) X(10, 2) X(11, 2) X(12, 2)      \
    X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1) X(7, 1) X(8, 1) X(9, 1) X(10, 1) X(11, 1) X(12, 1)      \
    X(13, 1) X(14, 1) X(15, 1) X(16, 1)
#define AVX512_PANEL_TILE_TABLES(FN)                                                                         \
    static const int SMALL_PANELS = 4, LARGE_PANELS = 2;                                                     \
    static const FN SMALL_TILES[SMALL_ROWS + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4};               \
    static const FN LARGE_TILES[LARGE_ROWS + 1] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2,      \
                                                   tile_6_2, tile_7_2, tile_8_2, tile_9_2, tile_10_2,        \
                                                   tile_11_2, tile_12_2};                                    \
    static const FN EDGE_TILES[EDGE_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1,        \
                                                 tile_6_1, tile_7_1, tile_8_1, tile_9_1, tile_10_1,          \
                                                 tile_11_1, tile_12_1, tile_13_1, tile_14_1, tile_15_1,      \
                                                 tile_16_1};
#endif
