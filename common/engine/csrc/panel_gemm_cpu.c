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
 * The vector type is GCC's vector extension, one AVX-512 register: built without AVX-512 the same
 * code runs on AVX2 halves, but the tiles' accumulators no longer fit the registers (5-10x slower
 * than oneDNN, measured with -march=haswell), so `panel_gemm_native` says whether to use it.  Accumulation order over k is sequential, as in a plain dot
 * product (results may differ from another library's in the last bits, as libraries do among
 * themselves).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
/* Each panel stream is prefetched this many k (64-byte lines) ahead: the hardware prefetchers
 * stop at page boundaries; the LM head at 8 rows 31 -> 27 ms with it. */
#define PREFETCH_AHEAD 32

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* All lanes x (a broadcast; ``(vec){0} + x`` would add, to keep -0.0's sign). */
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline void store_cols(float *dst, vec v, int cols) {
    if (cols == LANES) {
        memcpy(dst, &v, sizeof v);
    } else {
        float tmp[LANES];
        memcpy(tmp, &v, sizeof v);
        memcpy(dst, tmp, sizeof(float) * (size_t)cols);
    }
}

/* One tile: rows [0, R) of x (row stride ldx) by panels [0, P) starting at w; y's row stride ldy;
 * `cols` of the last panel are real (16 for every other). */
#define DEFINE_TILE(R, P)                                                                              \
    static void tile_##R##_##P(const float *x, int64_t ldx, const float *w, int64_t K, float *y,      \
                               int64_t ldy, int last_cols) {                                           \
        vec acc[R][P];                                                                                 \
        for (int r = 0; r < R; r++)                                                                    \
            for (int p = 0; p < P; p++) acc[r][p] = (vec){0};                                          \
        for (int64_t k = 0; k < K; k++) {                                                              \
            vec wv[P];                                                                                 \
            for (int p = 0; p < P; p++) {                                                              \
                wv[p] = load_vec(w + ((int64_t)p * K + k) * LANES);                                    \
                __builtin_prefetch(w + ((int64_t)p * K + k + PREFETCH_AHEAD) * LANES);                 \
            }                                                                                          \
            for (int r = 0; r < R; r++) {                                                              \
                vec xb = splat(x[(int64_t)r * ldx + k]);                                               \
                for (int p = 0; p < P; p++) acc[r][p] += xb * wv[p];                                   \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int p = 0; p < P; p++)                                                                \
                store_cols(y + (int64_t)r * ldy + p * LANES, acc[r][p], p == P - 1 ? last_cols : LANES); \
    }

DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1) DEFINE_TILE(6, 1) DEFINE_TILE(7, 1) DEFINE_TILE(8, 1)
DEFINE_TILE(9, 1) DEFINE_TILE(10, 1) DEFINE_TILE(11, 1) DEFINE_TILE(12, 1)
DEFINE_TILE(13, 1) DEFINE_TILE(14, 1) DEFINE_TILE(15, 1) DEFINE_TILE(16, 1)
DEFINE_TILE(1, 2) DEFINE_TILE(2, 2) DEFINE_TILE(3, 2) DEFINE_TILE(4, 2)
DEFINE_TILE(5, 2) DEFINE_TILE(6, 2) DEFINE_TILE(7, 2) DEFINE_TILE(8, 2)
DEFINE_TILE(9, 2) DEFINE_TILE(10, 2) DEFINE_TILE(11, 2) DEFINE_TILE(12, 2)
DEFINE_TILE(1, 4) DEFINE_TILE(2, 4) DEFINE_TILE(3, 4) DEFINE_TILE(4, 4)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);

/* Tiles by panels per group, then rows: four panels take up to 4 rows (16 accumulators), two up to
 * 12 (24 accumulators, two panel vectors: 26 of AVX-512's 32 registers), one up to 16 (the last,
 * partial group).  Enough independent chains to hide the FMA latency, and as many rows per pass
 * over the weights as the registers allow. */
#define MAX_TILE_ROWS 16
static const tile_fn TILES_1[17] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1,
                                    tile_7_1, tile_8_1, tile_9_1, tile_10_1, tile_11_1, tile_12_1,
                                    tile_13_1, tile_14_1, tile_15_1, tile_16_1};
static const tile_fn TILES_2[13] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2, tile_7_2, tile_8_2,
                                   tile_9_2, tile_10_2, tile_11_2, tile_12_2};
static const tile_fn TILES_4[5] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4};

/* Panels a group holds for `m` rows: with few rows, four panels give the independent chains; with
 * more, two panels by tiles of 12 rows (one panel by 16 rows streamed the weights slower, and tiles
 * of 8 rows passed over them more often: the LM head at 16 rows 40 / 35.5 / 32.9 ms). */
static int group_panels(int64_t m) { return m <= 4 ? 4 : 2; }

/* 1 where the tiles run on AVX-512 registers (the build's target), else 0: callers keep oneDNN. */
int panel_gemm_native(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

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
    const int per_group = group_panels(m);
    const int64_t groups = (num_panels + per_group - 1) / per_group;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
#endif
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * per_group;
        const int panels_here = (int)(num_panels - first < per_group ? num_panels - first : per_group);
        const int64_t col = first * LANES;
        const int64_t after_last = n - (first + panels_here - 1) * LANES; /* columns from the last panel on */
        const int last_cols = (int)(after_last < LANES ? after_last : LANES);
        const float *w = panels + first * k * LANES;
        if (panels_here == per_group && last_cols == LANES) {
            const int tile_rows = per_group == 4 ? 4 : per_group == 2 ? 12 : MAX_TILE_ROWS; /* see TILES_* */
            const tile_fn *tiles = per_group == 4 ? TILES_4 : per_group == 2 ? TILES_2 : TILES_1;
            for (int64_t r = 0; r < m; r += tile_rows) {
                int rows = (int)(m - r < tile_rows ? m - r : tile_rows);
                tiles[rows](x + r * ldx, ldx, w, k, y + r * ldy + col, ldy, LANES);
            }
        } else { /* the last, partial group: one panel at a time */
            for (int p = 0; p < panels_here; p++) {
                int cols = p == panels_here - 1 ? last_cols : LANES;
                for (int64_t r = 0; r < m; r += MAX_TILE_ROWS) {
                    int rows = (int)(m - r < MAX_TILE_ROWS ? m - r : MAX_TILE_ROWS);
                    TILES_1[rows](x + r * ldx, ldx, w + (int64_t)p * k * LANES, k, y + r * ldy + col + p * LANES,
                                  ldy, cols);
                }
            }
        }
    }
}
