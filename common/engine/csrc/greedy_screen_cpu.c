/* Greedy tokens from an fp32 LM head without every logit in fp32: screen with bf16, then compute
 * exactly the rows that can still be the maximum.
 *
 * A greedy decode step needs only each row's first maximal logit, but the LM head is the largest
 * product of the step (Gemma 3's 262k x 640).  Pass 1 computes every logit approximately from a
 * bf16 copy of the head (half the bytes; AVX512-BF16's dot product where the CPU has it) together
 * with a bound B_r on its distance from the fp32 logit, and keeps, per token, the best lower bound
 * T = max_r (a_r - B_r) and, per panel of 16 rows, the best upper bound max (a_r + B_r).  Pass 2
 * computes in fp32 -- on the head's fp32 panels, in the order panel_gemm_cpu.c does, so the values
 * are the ones the full product gives -- only the panels whose upper bound reaches T; a row outside
 * them is below T, hence below some row inside, so the first maximal row inside them is the first
 * maximal row of all.
 *
 * The bound (x the token's hidden row, w_r the head's row, ~ rounding to bf16, K the width):
 *   a_r - x.w_r = (x~ - x).w_r + x~.(w~_r - w_r) + (fp32 sum of exact bf16 products - x~.w~_r)
 *   |a_r - f_r| <= |x - x~| |w_r| + |x~| |w~_r - w_r| + g (|x~| |w~_r| + |x| |w_r|) + tiny
 * with f_r the fp32 logit (itself within g |x| |w_r| of x.w_r), g = K u / (1 - K u), u = 2^-24
 * (any summation order, fused or not), Cauchy-Schwarz for each dot product, and "tiny" the
 * subnormal products and sums the bf16 dot product flushes (its subnormal inputs are zero in the
 * copies already: to_bf16).  Row norms are computed at packing in double and
 * rounded up; the bound is widened by 1% and by 2^-21 |a_r| for its own fp32 evaluation.
 *
 * Pass 1 runs on AMX tiles where the CPU has them (16 tokens by 16 rows per tile; a decode batch
 * of 64 costs little more than one of 1, which reads the bf16 copy once), else on AVX-512 (with
 * AVX512-BF16's dot product where it exists), where large batches cost as much as fp32 does.
 *
 * Layouts: fp32 panels as panel_gemm_cpu.c ([K][16] per panel); bf16 panels [K2][16][2] (one
 * 64-byte load holds two k of 16 rows, as the dot products take them; K2 = K/2 rounded up to
 * PAIR_BLOCK, zero-padded), their count rounded up to whole groups of GROUP (zero rows past n,
 * excluded by a lane mask).
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define GROUP 4 /* bf16 panels a thread takes at a time */
#define PREFETCH_AHEAD 32
#define PAIR_BLOCK 16 /* pairs of k per AMX tile row: the bf16 panels' pair count is padded to it */
#define TOKEN_BLOCK 16 /* tokens per AMX tile */

#if defined(__AVX512F__)
#include <immintrin.h>
#define NATIVE 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#endif
#else
#define NATIVE 0
#endif

/* 1 where the screen has vector code for this CPU (AVX-512; its dot product with AVX512-BF16). */
int greedy_screen_native(void) { return NATIVE; }

static int screen_with_amx = 1;


/* Round to nearest even (finite inputs), subnormal results to zero: the dot products treat
 * subnormal inputs as zero, so the copies hold exactly what they multiply (and the bound, which
 * counts |x - x~| and |w - w~|, counts what the flush loses). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    const uint16_t h = (uint16_t)(u >> 16);
    return (h & 0x7F80u) == 0 ? 0 : h;
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float round_up(double v) { /* a float >= v (v >= 0) */
    float f = (float)v;
    return (double)f >= v ? f : nextafterf(f, INFINITY);
}

static inline int64_t padded_pairs(int64_t k) { return ((k + 1) / 2 + PAIR_BLOCK - 1) / PAIR_BLOCK * PAIR_BLOCK; }

static inline int64_t bf16_panels(int64_t n) {
    int64_t p = (n + LANES - 1) / LANES;
    return (p + GROUP - 1) / GROUP * GROUP;
}

/* The sizes greedy_screen_pack writes: bf16 elements of the panels, and row slots (norms). */
int64_t greedy_screen_pair_elems(int64_t n, int64_t k) { return bf16_panels(n) * LANES * 2 * padded_pairs(k); }

int64_t greedy_screen_row_slots(int64_t n) { return bf16_panels(n) * LANES; }

/* fp32 panels (n rows of width k) -> bf16 panels, each row's norm (the larger of |w| and |w~|)
 * and residual norm |w - w~|, rounded up (zero for rows past n).  Returns how many weights are not
 * finite, or round to a bf16 that is not: the caller keeps the fp32 product then. */
int64_t greedy_screen_pack(const float *panels, int64_t n, int64_t k, uint16_t *pairs, float *norm, float *residual,
                           int num_threads) {
    const int64_t k2 = padded_pairs(k), num_panels = bf16_panels(n);
    int64_t bad = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) reduction(+ : bad)
#endif
    for (int64_t j = 0; j < num_panels; j++) {
        uint16_t *dst = pairs + j * k2 * LANES * 2;
        for (int c = 0; c < LANES; c++) {
            const int64_t row = j * LANES + c;
            double sum_w = 0.0, sum_t = 0.0, sum_e = 0.0;
            for (int64_t i = 0; i < 2 * k2; i++) {
                const float w = row < n && i < k ? panels[(j * k + i) * LANES + c] : 0.0f;
                const uint16_t h = isfinite(w) ? to_bf16(w) : 0;
                const float t = from_bf16(h);
                if (!isfinite(w) || !isfinite(t)) bad++;
                dst[((i / 2) * LANES + c) * 2 + (i % 2)] = h;
                sum_w += (double)w * w;
                sum_t += (double)t * t;
                sum_e += ((double)w - t) * ((double)w - t);
            }
            const double w_norm = sqrt(sum_w > sum_t ? sum_w : sum_t);
            norm[row] = round_up(w_norm * (1.0 + 0x1p-40));
            residual[row] = round_up(sqrt(sum_e) * (1.0 + 0x1p-40));
        }
    }
    return bad;
}

#if NATIVE
static inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

/* One tile of pass 1: R tokens by P bf16 panels at w.  Accumulates the approximate logits, then
 * folds them into the tokens' lower bounds and the panels' upper bounds. */
#ifdef __AVX512BF16__
#define DOT(acc, wv, r, i) acc = _mm512_dpbf16_ps(acc, (__m512bh)(wv), (__m512bh)_mm512_set1_epi32((int)xp[(r) * k2 + (i)]))
#else
#define DOT(acc, wv, r, i)                                                                                   \
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), _mm512_set1_ps(xt[(r) * 2 * k2 + 2 * (i)]), acc); \
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, hi_mask)), _mm512_set1_ps(xt[(r) * 2 * k2 + 2 * (i) + 1]), acc)
#endif

typedef struct {
    int64_t n, k, k2, num_panels;
    const uint16_t *pairs; /* the bf16 panels */
    const uint32_t *xp;    /* [tokens][k2] x~ as pairs of bf16 */
    const float *xt;       /* [tokens][2 k2] x~ as floats */
    const float *alpha;    /* [tokens] bound per unit of row norm */
    const float *beta;     /* [tokens] bound per unit of residual norm */
    const float *norm, *residual;
    float tiny;
    float *upper;          /* [tokens][num_panels] */
} screen_args;

/* Fold one panel's approximate logits `a` of one token into the token's best lower bound and the
 * panel's upper bound (rows past n count as -inf). */
static void fold(const screen_args *s, int64_t token, int64_t panel, __m512 a, float *lower_max) {
    const __m512 nrm = _mm512_loadu_ps(s->norm + panel * LANES), res = _mm512_loadu_ps(s->residual + panel * LANES);
    __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(s->alpha[token]), nrm,
                                   _mm512_fmadd_ps(_mm512_set1_ps(s->beta[token]), res, _mm512_set1_ps(s->tiny)));
    bound = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.01f), _mm512_mul_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-21f)));
    const int64_t first = panel * LANES;
    const __mmask16 valid = first + LANES <= s->n ? (__mmask16)0xFFFF
                            : first >= s->n       ? (__mmask16)0
                                                  : (__mmask16)((1u << (s->n - first)) - 1u);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    /* A logit whose approximation overflowed (or a bound that did) says nothing: its panel is
     * computed in fp32 whatever T is, and it sets no lower bound. */
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_add_ps(a, bound)), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const float lo = hmax(_mm512_mask_sub_ps(neg_inf, valid & finite, a, bound));
    const float hi = (valid & ~finite) ? INFINITY : hmax(_mm512_mask_add_ps(neg_inf, valid, a, bound));
    if (lo > *lower_max) *lower_max = lo;
    s->upper[token * s->num_panels + panel] = hi;
}

/* R tokens (from token0) by P bf16 panels (from panel0): R*P accumulators in registers, each
 * 64-byte load of the weights feeds R dot products. */
#define DEFINE_TILE(R, P)                                                                                  \
    static void tile_##R##_##P(const screen_args *s, int64_t token0, int64_t panel0, float *lower_max) {    \
        const int64_t k2 = s->k2;                                                                          \
        __attribute__((unused)) const uint32_t *xp = s->xp + token0 * k2;                                  \
        __attribute__((unused)) const float *xt = s->xt + token0 * 2 * k2;                                 \
        __attribute__((unused)) const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);              \
        __m512 acc[R][P];                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                                   \
        const uint16_t *base = s->pairs + panel0 * k2 * LANES * 2;                                         \
        for (int64_t i = 0; i < k2; i++) {                                                                 \
            __m512i wv[P];                                                                                 \
            for (int p = 0; p < P; p++) {                                                                  \
                const uint16_t *src = base + ((int64_t)p * k2 + i) * LANES * 2;                             \
                wv[p] = _mm512_loadu_si512((const void *)src);                                             \
                __builtin_prefetch(src + PREFETCH_AHEAD * LANES * 2);                                      \
            }                                                                                              \
            for (int r = 0; r < R; r++)                                                                    \
                for (int p = 0; p < P; p++) { DOT(acc[r][p], wv[p], r, i); }                               \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int p = 0; p < P; p++) fold(s, token0 + r, panel0 + p, acc[r][p], &lower_max[r]);         \
    }

typedef void (*tile_fn)(const screen_args *, int64_t, int64_t, float *);
#define SMALL_TOKENS 4 /* up to this many tokens: tiles of GROUP panels, else of 2 panels */
#define LARGE_TOKENS 12
DEFINE_TILE(1, 4) DEFINE_TILE(2, 4) DEFINE_TILE(3, 4) DEFINE_TILE(4, 4)
DEFINE_TILE(1, 2) DEFINE_TILE(2, 2) DEFINE_TILE(3, 2) DEFINE_TILE(4, 2) DEFINE_TILE(5, 2) DEFINE_TILE(6, 2)
DEFINE_TILE(7, 2) DEFINE_TILE(8, 2) DEFINE_TILE(9, 2) DEFINE_TILE(10, 2) DEFINE_TILE(11, 2) DEFINE_TILE(12, 2)
static const tile_fn SMALL_TILES[SMALL_TOKENS + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4};
static const tile_fn LARGE_TILES[LARGE_TOKENS + 1] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2,
                                                      tile_7_2, tile_8_2, tile_9_2, tile_10_2, tile_11_2, tile_12_2};

#ifdef AMX
/* Linux hands out AMX state only to a process that asks (once; oneDNN may have asked already). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0, tmm1: two panels' logits of 16 tokens (fp32); tmm2: the tokens' x~ (16 pairs of k);
 * tmm3, tmm4: the two panels' weights (16 pairs of k by 16 rows). */
static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 5; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

/* Tokens [token0, token0 + 16) (x~ zero-padded past the real ones) by panels panel0, panel0 + 1;
 * folds the first `real` tokens. */
static void amx_tile(const screen_args *s, int64_t token0, int64_t panel0, int64_t real, float *lower_max) {
    const int64_t k2 = s->k2;
    const uint32_t *a = s->xp + token0 * k2;
    const uint16_t *b0 = s->pairs + panel0 * k2 * LANES * 2, *b1 = b0 + k2 * LANES * 2;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t i = 0; i < k2; i += PAIR_BLOCK) {
        _tile_loadd(2, a + i, k2 * 4);
        _tile_loadd(3, b0 + i * LANES * 2, LANES * 4);
        _tile_loadd(4, b1 + i * LANES * 2, LANES * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    float out[2][TOKEN_BLOCK][LANES];
    _tile_stored(0, out[0], LANES * 4);
    _tile_stored(1, out[1], LANES * 4);
    for (int64_t r = 0; r < real; r++)
        for (int p = 0; p < 2; p++) fold(s, token0 + r, panel0 + p, _mm512_loadu_ps(out[p][r]), &lower_max[r]);
}
#endif

/* The fp32 logits of one panel's 16 rows for token x (K wide): the product panel_gemm_cpu.c
 * computes, in its order (one fused multiply-add per k, k ascending). */
static inline __m512 exact_panel(const float *x, const float *panel, int64_t k) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_loadu_ps(panel + i * LANES), acc);
    return acc;
}
#endif

/* Which pass 1 runs: 2 AMX tiles (where the CPU has them and Linux grants them), 1 AVX-512, 0 none;
 * `allow_amx` 0 keeps AMX out (tests compare the two). */
int greedy_screen_path(int allow_amx) {
    screen_with_amx = allow_amx != 0;
#if defined(AMX)
    if (screen_with_amx && amx_permitted()) return 2;
#endif
    return NATIVE;
}

/* For each of `tokens` rows of x [tokens, k] (row stride ldx): the first index of the largest
 * logit of x @ W^T, W [n, k] given as fp32 panels (`panels`) and as greedy_screen_pack's bf16
 * panels with their norms.  Writes tokens[t]; returns the number of rows computed in fp32 (the
 * candidates: a few per token), -1 where scratch memory could not be had, -2 where a row of x or
 * a candidate's logit is not finite (the caller computes those tokens' logits in full), -3 where
 * the build has no vector code. */
int64_t greedy_screen(const float *x, int64_t ldx, int64_t num_tokens, const float *panels, const uint16_t *pairs,
                      const float *norm, const float *residual, int64_t n, int64_t k, int64_t *out, int num_threads) {
#if !NATIVE
    (void)x; (void)ldx; (void)num_tokens; (void)panels; (void)pairs; (void)norm; (void)residual; (void)n; (void)k;
    (void)out; (void)num_threads;
    return -3;
#else
    const int64_t k2 = padded_pairs(k), num_panels = bf16_panels(n), real_panels = (n + LANES - 1) / LANES;
    const int64_t padded_tokens = (num_tokens + TOKEN_BLOCK - 1) / TOKEN_BLOCK * TOKEN_BLOCK;
    const int threads = num_threads > 0 ? num_threads : 1;
    uint32_t *xp = calloc((size_t)(padded_tokens * k2), sizeof(uint32_t)); /* AMX reads whole tiles */
    float *xt = malloc(sizeof(float) * (size_t)(num_tokens * 2 * k2));
    float *alpha = malloc(sizeof(float) * (size_t)num_tokens), *beta = malloc(sizeof(float) * (size_t)num_tokens);
    float *upper = malloc(sizeof(float) * (size_t)(num_tokens * num_panels));
    float *lower = malloc(sizeof(float) * (size_t)(threads * num_tokens));
    float *best = malloc(sizeof(float) * (size_t)(threads * num_tokens));
    int64_t *best_row = malloc(sizeof(int64_t) * (size_t)(threads * num_tokens));
    int64_t status = 0;
    if (!xp || !xt || !alpha || !beta || !upper || !lower || !best || !best_row) {
        status = -1;
        goto done;
    }
    for (int64_t i = 0; i < (int64_t)threads * num_tokens; i++) best_row[i] = -1; /* threads OpenMP did not start */
    /* x~ and each token's bound coefficients (in double, rounded up). */
    const double g = (double)k * 0x1p-24 / (1.0 - (double)k * 0x1p-24);
    for (int64_t t = 0; t < num_tokens && status == 0; t++) {
        double sum_x = 0.0, sum_t = 0.0, sum_e = 0.0;
        for (int64_t i = 0; i < 2 * k2; i++) {
            const float v = i < k ? x[t * ldx + i] : 0.0f;
            if (!isfinite(v)) {
                status = -2;
                break;
            }
            const uint16_t h = to_bf16(v);
            const float r = from_bf16(h);
            xt[t * 2 * k2 + i] = r;
            if (i % 2 == 0) xp[t * k2 + i / 2] = h;
            else xp[t * k2 + i / 2] |= (uint32_t)h << 16;
            sum_x += (double)v * v;
            sum_t += (double)r * r;
            sum_e += ((double)v - r) * ((double)v - r);
        }
        const double nx = sqrt(sum_x), nt = sqrt(sum_t);
        alpha[t] = round_up((sqrt(sum_e) + g * (nx + nt)) * (1.0 + 0x1p-40));
        beta[t] = round_up(nt * (1.0 + 0x1p-40));
        if (!isfinite(alpha[t]) || !isfinite(beta[t])) status = -2;
    }
    if (status != 0) goto done;
    const screen_args s = {n, k, k2, num_panels, pairs, xp, xt, alpha, beta, norm, residual,
                           (float)(k + 16) * 0x1p-118f, upper};
    const int64_t groups = num_panels / GROUP;
#ifdef AMX
    /* Up to SMALL_TOKENS tokens the AVX-512 tiles read the weights as fast, without 16-token tiles. */
    const int use_amx = num_tokens > SMALL_TOKENS && screen_with_amx && amx_permitted();
#endif
    int64_t exact_rows = 0, not_finite = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : exact_rows, not_finite)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int tid = 0, nt = 1;
#endif
        const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
        float *my_lower = lower + (int64_t)tid * num_tokens;
        for (int64_t t = 0; t < num_tokens; t++) my_lower[t] = -INFINITY;
        /* Pass 1: approximate logits, bounds. */
#ifdef AMX
        if (use_amx) amx_configure();
#endif
        for (int64_t g = g0; g < g1; g++) {
            const int64_t panel0 = g * GROUP;
#ifdef AMX
            if (use_amx) {
                for (int64_t t = 0; t < num_tokens; t += TOKEN_BLOCK) {
                    const int64_t real = num_tokens - t < TOKEN_BLOCK ? num_tokens - t : TOKEN_BLOCK;
                    for (int64_t pair = 0; pair < GROUP; pair += 2) amx_tile(&s, t, panel0 + pair, real, my_lower + t);
                }
                continue;
            }
#endif
            if (num_tokens <= SMALL_TOKENS) {
                SMALL_TILES[num_tokens](&s, 0, panel0, my_lower);
            } else {
                for (int64_t half = 0; half < GROUP; half += 2)
                    for (int64_t t = 0; t < num_tokens; t += LARGE_TOKENS) {
                        const int64_t r = num_tokens - t < LARGE_TOKENS ? num_tokens - t : LARGE_TOKENS;
                        LARGE_TILES[r](&s, t, panel0 + half, my_lower + t);
                    }
            }
        }
#ifdef AMX
        if (use_amx) _tile_release();
#endif
#ifdef _OPENMP
#pragma omp barrier
#endif
        /* Pass 2: the panels that may hold the maximum, in fp32. */
        float *my_best = best + (int64_t)tid * num_tokens;
        int64_t *my_row = best_row + (int64_t)tid * num_tokens;
        const int64_t p0 = g0 * GROUP, p1 = g1 * GROUP < real_panels ? g1 * GROUP : real_panels;
        for (int64_t t = 0; t < num_tokens; t++) {
            float threshold = -INFINITY;
            for (int i = 0; i < nt; i++)
                if (lower[(int64_t)i * num_tokens + t] > threshold) threshold = lower[(int64_t)i * num_tokens + t];
            float top = -INFINITY;
            int64_t top_row = -1;
            for (int64_t p = p0; p < p1; p++) {
                if (upper[t * num_panels + p] < threshold) continue;
                float v[LANES];
                _mm512_storeu_ps(v, exact_panel(x + t * ldx, panels + p * k * LANES, k));
                for (int c = 0; c < LANES && p * LANES + c < n; c++) {
                    exact_rows++;
                    if (!isfinite(v[c])) not_finite++;
                    if (v[c] > top || top_row < 0) {
                        top = v[c];
                        top_row = p * LANES + c;
                    }
                }
            }
            my_best[t] = top;
            my_row[t] = top_row;
        }
    }
    if (not_finite) {
        status = -2;
        goto done;
    }
    /* Threads own ascending ranges of rows: a later thread's row wins only when strictly larger. */
    for (int64_t t = 0; t < num_tokens; t++) {
        float top = -INFINITY;
        int64_t top_row = -1;
        for (int i = 0; i < threads; i++) {
            const int64_t row = best_row[(int64_t)i * num_tokens + t];
            const float v = best[(int64_t)i * num_tokens + t];
            if (row >= 0 && (top_row < 0 || v > top)) {
                top = v;
                top_row = row;
            }
        }
        out[t] = top_row;
    }
    status = exact_rows;
done:
    free(xp);
    free(xt);
    free(alpha);
    free(beta);
    free(upper);
    free(lower);
    free(best);
    free(best_row);
    return status;
#endif
}
