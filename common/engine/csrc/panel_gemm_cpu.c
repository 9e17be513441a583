/* y[M, N] = x[M, K] @ W[N, K]^T in fp32 for few rows M (decode steps), W packed in panels.
 *
 * Packed layout (pack_panels): W's rows grouped 16 at a time into panels; panel j holds rows
 * 16j..16j+15 transposed, [K][16] contiguous, so one 64-byte load is one k of 16 outputs:
 *
 *   panels[j][k][c] = W[16 j + c][k]     (rows past N are zero)
 *
 * A tile of R rows of x by P panels keeps R*P 16-wide accumulators in registers; for each k it
 * loads the P panel vectors once and multiplies each by the R broadcast values of x[:, k]: the
 * weights stream from memory once per tile and every byte feeds R multiply-adds, where a decode
 * step at batch M is bound by reading the weights.  Threads split the panel groups (OpenMP,
 * static); a thread runs every row tile over its group while the group's panels are in cache.
 * The vector type is GCC's vector extension, one native register (16 floats on AVX-512, 8 on
 * AVX2: a panel is then two registers), and the tiles are sized per instruction set so their
 * accumulators stay in registers (a 16-wide type built for AVX2 lives on the stack: 5-10x slower
 * than oneDNN); `panel_gemm_native` says whether the build has tiles for its CPU.  Accumulation
 * order over k is sequential, as in a plain dot product (results may differ from another
 * library's in the last bits, as libraries do among themselves).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <string.h>

#include "panel_groups.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
/* Each panel stream is prefetched this many k (64-byte lines) ahead: the hardware prefetchers
 * stop at page boundaries; the LM head at 8 rows 31 -> 27 ms with it. */
#define PREFETCH_AHEAD 32

#if defined(__AVX512F__)
#define VW 16 /* floats per native vector */
#define NATIVE 1
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define NATIVE 1
#else
#define VW 8 /* correct, but not sized for this CPU's registers: callers keep oneDNN */
#define NATIVE 0
#endif
#define SUB (LANES / VW) /* native vectors per panel */

typedef float vec __attribute__((vector_size(VW * sizeof(float))));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* All lanes x (a broadcast; ``(vec){0} + x`` would add, to keep -0.0's sign). */
#if VW == 16
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
#endif

/* The first `cols` outputs of one panel's SUB vectors. */
static inline void store_cols(float *dst, const vec *v, int cols) {
    if (cols == LANES) {
        memcpy(dst, v, sizeof(vec) * SUB);
    } else {
        float tmp[LANES];
        memcpy(tmp, v, sizeof tmp);
        memcpy(dst, tmp, sizeof(float) * (size_t)cols);
    }
}

/* One tile: rows [0, R) of x (row stride ldx) by panels [0, P) starting at w; y's row stride ldy;
 * `cols` of the last panel are real (16 for every other).  `next` (or NULL): the next group's P
 * panels, prefetched into L2 along the way -- the group's first row tile passes it, so that the
 * next group's first tile reads L2, not memory, while this group's other row tiles compute (on
 * the AVX2 EPYC, the layers and LM head at 8 rows 48 -> 42 ms, 16 rows 86 -> 74 ms, 32 rows 127 -> 119). */
#define DEFINE_TILE(R, P)                                                                              \
    __attribute__((unused)) static void tile_##R##_##P(const float *x, int64_t ldx, const float *w,  \
                                                       int64_t K, float *y, int64_t ldy, int last_cols, const float *next) { \
        vec acc[R][P * SUB];                                                                           \
        for (int r = 0; r < R; r++)                                                                    \
            for (int v = 0; v < P * SUB; v++) acc[r][v] = (vec){0};                                    \
        for (int64_t k = 0; k < K; k++) {                                                              \
            vec wv[P * SUB];                                                                           \
            for (int p = 0; p < P; p++) {                                                              \
                for (int s = 0; s < SUB; s++) wv[p * SUB + s] = load_vec(w + ((int64_t)p * K + k) * LANES + s * VW); \
                __builtin_prefetch(w + ((int64_t)p * K + k + PREFETCH_AHEAD) * LANES);                 \
                if (next) __builtin_prefetch(next + ((int64_t)p * K + k) * LANES, 0, 1);               \
            }                                                                                          \
            for (int r = 0; r < R; r++) {                                                              \
                vec xb = splat(x[(int64_t)r * ldx + k]);                                               \
                for (int v = 0; v < P * SUB; v++) acc[r][v] += xb * wv[v];                             \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int p = 0; p < P; p++)                                                                \
                store_cols(y + (int64_t)r * ldy + p * LANES, &acc[r][p * SUB], p == P - 1 ? last_cols : LANES); \
    }

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, const float *);

/* The tiling, per instruction set: products of up to SMALL_ROWS rows take groups of SMALL_PANELS
 * panels (enough independent chains to hide the FMA latency with few rows), more rows take groups
 * of LARGE_PANELS panels by tiles of LARGE_ROWS rows (as many rows per pass over the weights as
 * the registers allow); the last, partial group goes one panel at a time by EDGE_ROWS rows. */
#if VW == 16
#include "panel_tiles.h" /* the AVX-512 tiling, shared with bf16_panel_cpu.c */
AVX512_PANEL_TILES(DEFINE_TILE)
AVX512_PANEL_TILE_TABLES(tile_fn)
#else
/* AVX2's 16 registers, a panel in two: 2 panels x 3 rows (12 accumulators, the panel vectors read
 * from memory by the FMAs), 1 panel x 6 rows (12, two panel vectors and the broadcast).  On a
 * 2-vCPU AMD EPYC (Zen 4 without AVX-512), oneDNN -> these tiles, Gemma 3 270M's 18 layers of
 * products then its LM head: 1 row 28 -> 17 and 30 -> 23 ms, 8 rows 43 -> 23 and 53 -> 36 ms,
 * 16 rows 53 -> 35 and 72 -> 54 ms, 32 rows 84 -> 57..95 and 105 -> 86 ms. */
#define SMALL_ROWS 3
#define LARGE_ROWS 6
#define EDGE_ROWS 6
DEFINE_TILE(1, 2) DEFINE_TILE(2, 2) DEFINE_TILE(3, 2)
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1) DEFINE_TILE(5, 1) DEFINE_TILE(6, 1)
static const int SMALL_PANELS = 2, LARGE_PANELS = 1;
static const tile_fn SMALL_TILES[SMALL_ROWS + 1] = {0, tile_1_2, tile_2_2, tile_3_2};
static const tile_fn LARGE_TILES[LARGE_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
static const tile_fn EDGE_TILES[EDGE_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
#endif

/* 1 where the tiles are sized for the build's registers (AVX-512, or AVX2 with FMA), else 0:
 * callers keep oneDNN. */
int panel_gemm_native(void) { return NATIVE; }

/* w: [N, K] row-major (any row stride ldw) -> panels: ceil(N / 16) * K * 16 floats. */
void pack_panels(const float *w, int64_t ldw, int64_t n, int64_t k, float *panels, int num_threads) {
    const int64_t num_panels = (n + LANES - 1) / LANES;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
#endif
    for (int64_t j = 0; j < num_panels; j++) {
        float *dst = panels + j * k * LANES;
        for (int c = 0; c < LANES; c++) {
            int64_t row = j * LANES + c;
            if (row < n) {
                const float *src = w + row * ldw;
                for (int64_t i = 0; i < k; i++) dst[i * LANES + c] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * LANES + c] = 0.0f;
            }
        }
    }
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T, W packed by pack_panels. */
void panel_gemm(const float *x, int64_t ldx, const float *panels, int64_t m, int64_t n, int64_t k, float *y,
                int64_t ldy, int num_threads) {
    const int64_t num_panels = (n + LANES - 1) / LANES;
    const int small = m <= SMALL_ROWS;
    const int per_group = small ? SMALL_PANELS : LARGE_PANELS;
    const int tile_rows = small ? SMALL_ROWS : LARGE_ROWS;
    const tile_fn *tiles = small ? SMALL_TILES : LARGE_TILES;
    const int64_t groups = (num_panels + per_group - 1) / per_group;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
#endif
    for (int64_t g = 0; g < groups; g++) {
        const panel_group group = panel_group_at(g, per_group, n, LANES);
        const int64_t first = group.first, col = first * LANES;
        const int panels_here = group.count, last_cols = group.last_cols;
        const float *w = panels + first * k * LANES;
        if (panels_here == per_group && last_cols == LANES) {
            const float *next = g + 1 < groups ? w + (int64_t)per_group * k * LANES : NULL;
            for (int64_t r = 0; r < m; r += tile_rows) {
                int rows = (int)(m - r < tile_rows ? m - r : tile_rows);
                tiles[rows](x + r * ldx, ldx, w, k, y + r * ldy + col, ldy, LANES, r == 0 ? next : NULL);
            }
        } else { /* the last, partial group: one panel at a time */
            for (int p = 0; p < panels_here; p++) {
                int cols = p == panels_here - 1 ? last_cols : LANES;
                for (int64_t r = 0; r < m; r += EDGE_ROWS) {
                    int rows = (int)(m - r < EDGE_ROWS ? m - r : EDGE_ROWS);
                    EDGE_TILES[rows](x + r * ldx, ldx, w + (int64_t)p * k * LANES, k, y + r * ldy + col + p * LANES,
                                     ldy, cols, NULL);
                }
            }
        }
    }
}
