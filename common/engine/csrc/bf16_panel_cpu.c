/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a bf16 model's products of few rows (decode steps), on
 * CPUs with AVX512-BF16; y in bf16 (the fp32 sums rounded to nearest even, as torch's bf16 linear
 * gives them).
 *
 * Why: a bf16 model's products otherwise run on oneDNN, which for a handful of rows streams the
 * weights at about half the memory's rate (Zen 4, 2 threads: the 262k x 640 LM head at 1 row 14 ms
 * for its 335 MB) -- bf16 decoding was slower than fp32 on its panels.  _mm512_dpbf16_ps adds two
 * bf16 products into each of 16 fp32 lanes: 32 multiply-adds an instruction on the weight as it is
 * stored, twice fp32's FMA rate.
 *
 * Layout (pack_bf16_panels): W's rows 16 at a time into panels of input pairs,
 *   panels[j][i][c][t] = W[16 j + c][2 i + t]   (zero past N, and past K when K is odd)
 * so one 64-byte load is one pair of inputs of 16 outputs; each row's pair of inputs is broadcast to
 * every lane.  The tiles and the threads' split are panel_gemm_cpu.c's: R rows by P panels keep R x P
 * accumulators in registers, so every weight byte read feeds R rows.  Each output is its fp32 sum
 * over the pairs in order (pair products exact in fp32; an input or product too small for a normal
 * fp32 counts as zero, as the instruction does), plus the bias, then rounded once.
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes. */
#include <stdint.h>
#include <string.h>

#include "panel_groups.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define LANES 16
/* Panel lines (64 bytes: a pair of inputs of 16 outputs) prefetched ahead of each panel's stream:
 * the hardware prefetchers stop at page boundaries. */
#define PREFETCH_AHEAD 32

/* Row r's inputs 2i and 2i + 1 as one 32-bit pair; the last pair of an odd K has a zero second. */
static inline __m512i pair_of(const uint16_t *x, int64_t i, int64_t k) {
    uint32_t v;
    if (2 * i + 1 < k) {
        memcpy(&v, x + 2 * i, sizeof v);
    } else {
        v = x[2 * i];
    }
    return _mm512_set1_epi32((int)v);
}

/* acc + bias (fp32 of the bf16 bias, or none) rounded to bf16 into dst's first `cols` values. */
static inline void store_bf16(uint16_t *dst, __m512 acc, const uint16_t *bias, int cols) {
    const __mmask16 mask = cols == LANES ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    if (bias) {
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias);
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
    const __m256bh rounded = _mm512_cvtneps_pbh(acc);
    __m256i bits;
    memcpy(&bits, &rounded, sizeof bits);
    _mm256_mask_storeu_epi16(dst, mask, bits);
}

/* One tile: rows [0, R) of x (row stride ldx) by panels [0, P) from w (K2 pairs each); `cols` of the
 * last panel are real.  `next` (or NULL): the next group's P panels, prefetched into L2 along the way
 * by the group's first row tile, as panel_gemm_cpu.c does (Gemma 3 270M's 72 layer products on a
 * Zen 4, 2 threads: 1 row 6.95 -> 6.75 ms, 8 rows 8.74 -> 7.51 ms). */
#define DEFINE_TILE(R, P)                                                                              \
    static void tile_##R##_##P(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k, int64_t k2, \
                               uint16_t *y, int64_t ldy, const uint16_t *bias, int last_cols,           \
                               const uint16_t *next) {                                                  \
        __m512 acc[R][P];                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                               \
        for (int64_t i = 0; i < k2; i++) {                                                             \
            __m512bh wv[P];                                                                            \
            for (int p = 0; p < P; p++) {                                                              \
                const uint16_t *line = w + ((int64_t)p * k2 + i) * 2 * LANES;                          \
                const __m512i raw = _mm512_loadu_si512((const void *)line);                            \
                memcpy(&wv[p], &raw, sizeof raw);                                                      \
                __builtin_prefetch(line + PREFETCH_AHEAD * 2 * LANES);                                 \
                if (next) __builtin_prefetch(next + ((int64_t)p * k2 + i) * 2 * LANES, 0, 1);          \
            }                                                                                          \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512i pair = pair_of(x + (int64_t)r * ldx, i, k);                              \
                __m512bh xb;                                                                           \
                memcpy(&xb, &pair, sizeof pair);                                                       \
                for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[p], xb);        \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int p = 0; p < P; p++)                                                                \
                store_bf16(y + (int64_t)r * ldy + p * LANES, acc[r][p], bias ? bias + p * LANES : NULL, \
                           p == P - 1 ? last_cols : LANES);                                            \
    }

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, uint16_t *, int64_t,
                        const uint16_t *, int, const uint16_t *);

#include "panel_tiles.h" /* the AVX-512 tiling of panel_gemm_cpu.c */
AVX512_PANEL_TILES(DEFINE_TILE)
AVX512_PANEL_TILE_TABLES(tile_fn)

/* w: [N, K] bf16 row-major (row stride ldw) -> panels: ceil(N / 16) * ceil(K / 2) * 32 values. */
void pack_bf16_panels(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint16_t *panels, int num_threads) {
    const int64_t num_panels = (n + LANES - 1) / LANES, k2 = (k + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t j = 0; j < num_panels; j++) {
        uint16_t *dst = panels + j * k2 * 2 * LANES;
        for (int c = 0; c < LANES; c++) {
            const int64_t row = j * LANES + c;
            for (int64_t kk = 0; kk < 2 * k2; kk++)
                dst[(kk / 2) * 2 * LANES + c * 2 + kk % 2] = row < n && kk < k ? w[row * ldw + kk] : 0;
        }
    }
}

/* y[m, n] (bf16, row stride ldy) = x[m, k] (bf16, row stride ldx) @ W^T + bias (bf16 [n] or NULL),
 * W packed by pack_bf16_panels. */
void bf16_panel_gemm(const uint16_t *x, int64_t ldx, const uint16_t *panels, const uint16_t *bias, int64_t m,
                     int64_t n, int64_t k, uint16_t *y, int64_t ldy, int num_threads) {
    const int64_t num_panels = (n + LANES - 1) / LANES, k2 = (k + 1) / 2;
    const int small = m <= SMALL_ROWS;
    const int per_group = small ? SMALL_PANELS : LARGE_PANELS;
    const int tile_rows = small ? SMALL_ROWS : LARGE_ROWS;
    const tile_fn *tiles = small ? SMALL_TILES : LARGE_TILES;
    const int64_t groups = (num_panels + per_group - 1) / per_group;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t g = 0; g < groups; g++) {
        const panel_group group = panel_group_at(g, per_group, n, LANES);
        const int64_t first = group.first, col = first * LANES;
        const int panels_here = group.count, last_cols = group.last_cols;
        const uint16_t *w = panels + first * k2 * 2 * LANES;
        const uint16_t *b = bias ? bias + col : NULL;
        if (panels_here == per_group && last_cols == LANES) {
            for (int64_t r = 0; r < m; r += tile_rows) {
                const int rows = (int)(m - r < tile_rows ? m - r : tile_rows);
                tiles[rows](x + r * ldx, ldx, w, k, k2, y + r * ldy + col, ldy, b, LANES,
                            r == 0 && g + 1 < groups ? w + (int64_t)per_group * k2 * 2 * LANES : NULL);
            }
        } else { /* the last, partial group: one panel at a time */
            for (int p = 0; p < panels_here; p++) {
                const int cols = p == panels_here - 1 ? last_cols : LANES;
                for (int64_t r = 0; r < m; r += EDGE_ROWS) {
                    const int rows = (int)(m - r < EDGE_ROWS ? m - r : EDGE_ROWS);
                    EDGE_TILES[rows](x + r * ldx, ldx, w + (int64_t)p * k2 * 2 * LANES, k, k2,
                                     y + r * ldy + col + p * LANES, ldy, b ? b + p * LANES : NULL, cols, NULL);
                }
            }
        }
    }
}
#endif
