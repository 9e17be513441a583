/* Greedy tokens from an fp32 LM head without every logit in fp32: screen with bf16, then compute
 * exactly the rows that can still be the maximum.  (Sampled tokens take the same bounds as the
 * envelope of a rejection sampler: fold_mass, greedy_screen_cpu_sample.h.)
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
 * AVX512-BF16's dot product where it exists; greedy_screen_cpu_avx512.h) or AVX2 with FMA
 * (greedy_screen_cpu_avx2.h), where large batches cost as much as fp32 does: the gain there is
 * reading half the bytes.
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
#define SAMPLE_TRIALS 64 /* rejection-sampling trials of a sampled token before it is left to the caller */

#if defined(__AVX512F__)
#include <immintrin.h>
#define NATIVE 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx.h"
#define AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NATIVE 1
/* AVX2 has no bf16 dot product: its FMAs take x in fp32 as it is (x~ = x), and a pair's odd k as
 * all 32 bits of the pair, saving a mask per load (greedy_screen_cpu_avx2.h): the copy of an odd k
 * is then the float whose high half is chosen so that, with the even k's bf16 as its low half, it
 * is nearest the weight (the norms count what it is). */
#define EXACT_X 1
#define ODD_TAKES_PAIR 1
#else
#define NATIVE 0
#endif
#ifndef EXACT_X
#define EXACT_X 0
#define ODD_TAKES_PAIR 0
#endif

/* 1 where the screen has vector code for this CPU (AVX-512, its dot product with AVX512-BF16; or
 * AVX2 with FMA). */
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

/* The float of the 32 bits (high, low). */
static inline float pair_float(uint16_t high, uint16_t low) {
    const uint32_t u = (uint32_t)high << 16 | low;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float from_bf16(uint16_t h) { return pair_float(h, 0); }

/* The high half that makes (high, low) the finite float nearest w (w finite). */
static inline uint16_t nearest_high_half(float w, uint16_t low) {
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    uint16_t best = (uint16_t)(u >> 16);
    double best_error = INFINITY;
    for (int step = -1; step <= 1; step++) {
        const uint16_t high = (uint16_t)((u >> 16) + step);
        const float f = pair_float(high, low);
        const double error = fabs((double)w - (double)f);
        if (isfinite(f) && error < best_error) {
            best = high;
            best_error = error;
        }
    }
    return best;
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
                uint16_t *slot = dst + ((i / 2) * LANES + c) * 2 + (i % 2);
                uint16_t h;
                float t;
                if (ODD_TAKES_PAIR && i % 2 == 1) {
                    h = isfinite(w) ? nearest_high_half(w, slot[-1]) : 0;
                    t = pair_float(h, slot[-1]);
                } else {
                    h = isfinite(w) ? to_bf16(w) : 0;
                    t = from_bf16(h);
                }
                if (!isfinite(w) || !isfinite(t)) bad++;
                *slot = h;
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
typedef struct {
    int64_t n, k, k2, num_panels;
    const uint16_t *pairs; /* the bf16 panels */
    const uint32_t *xp;    /* [tokens][k2] x~ as pairs of bf16 */
    const float *xt;       /* [tokens][2 k2] x~ as floats */
    const float *alpha;    /* [tokens] bound per unit of row norm */
    const float *beta;     /* [tokens] bound per unit of residual norm */
    const float *norm, *residual;
    float tiny;
    float *upper;          /* [tokens][num_panels]: a greedy token's upper bounds, a sampled one's m_j */
    const float *inv_t;    /* [tokens] 1 / temperature of a sampled token, 0 for greedy ones (or NULL: all greedy) */
    float *mass;           /* [tokens][num_panels]: a sampled token's s_j */
} screen_args;

typedef void (*tile_fn)(const screen_args *, int64_t, int64_t, float *);

static inline int sampled(const screen_args *s, int64_t token) { return s->inv_t != NULL && s->inv_t[token] > 0.0f; }

/* How many of a panel's LANES rows are real (not past n). */
static inline int panel_rows(const screen_args *s, int64_t panel) {
    const int64_t left = s->n - panel * LANES;
    return left <= 0 ? 0 : left >= LANES ? LANES : (int)left;
}

#include "vec16.h" /* vec16, ivec16, exp_nonpositive */

/* Pass 1 of a sampled token, one panel: from its `real` rows' upper bounds hi[c] >= l_c (their
 * largest `top`; `overflowed` where one is not finite), the panel's m_j = max z_c and
 * s_j = sum exp(z_c - m_j), z_c = hi[c] / T widened by 2^-20 |z_c| for its own rounding (so
 * z_c >= l_c / T; the widening is monotone, so m_j is top's): U_j = s_j exp(m_j - M) bounds the
 * panel's mass sum exp(l_c / T - M) from above, up to the float evaluation of the exps and sums
 * (sample_token allows 2^-10 for it).  A bound that is not finite makes m_j infinite: the token
 * is then left to the caller. */
static void fold_mass(const screen_args *s, int64_t token, int64_t panel, const float *hi, int real, float top,
                      int overflowed) {
    const float inv_t = s->inv_t[token];
    float m = top * inv_t, sum = 0.0f;
    m += fabsf(m) * 0x1p-20f;
    if (real == 0) {
        m = -INFINITY;
    } else if (overflowed || !isfinite(m)) {
        m = INFINITY;
    } else {
        vec16 z;
        memcpy(&z, hi, sizeof z);
        z *= inv_t;
        z += (vec16)((ivec16)z & 0x7FFFFFFF) * 0x1p-20f;
        const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const vec16 e = (vec16)((ivec16)exp_nonpositive(z - m) & (lane < real)); /* rows past n: 0 */
        for (int c = 0; c < LANES; c++) sum += e[c];
    }
    s->upper[token * s->num_panels + panel] = m;
    s->mass[token * s->num_panels + panel] = sum;
}

/* Each defines pass 1's tiles (SMALL_TILES for up to SMALL_TOKENS tokens over GROUP panels,
 * LARGE_TILES for up to LARGE_TOKENS tokens over LARGE_PANELS panels) and pass 2's exact_panel. */
#if defined(__AVX512F__)
#include "greedy_screen_cpu_avx512.h"
#else
#include "greedy_screen_cpu_avx2.h"
#endif

#include "greedy_screen_cpu_sample.h"
#endif

/* Which pass 1 runs: 2 AMX tiles (where the CPU has them and Linux grants them), 1 AVX-512, 3 AVX2,
 * 0 none; `allow_amx` 0 keeps AMX out (tests compare the two). */
int greedy_screen_path(int allow_amx) {
    screen_with_amx = allow_amx != 0;
#if defined(AMX)
    if (screen_with_amx && amx_permitted()) return 2;
#endif
#if defined(__AVX512F__)
    return 1;
#else
    return NATIVE ? 3 : 0;
#endif
}

/* For each of `tokens` rows of x [tokens, k] (row stride ldx): the first index of the largest
 * logit of x @ W^T, W [n, k] given as fp32 panels (`panels`) and as greedy_screen_pack's bf16
 * panels with their norms -- or, for a token whose inv_temperature[t] is > 0 (inv_temperature may
 * be NULL: none), a sample of softmax(logits / T) by sample_token, from uniforms[t][SAMPLE_TRIALS][3]
 * (trials[t]: the trials it took; 0 for an argmax).  Writes out[t] -- -1 for a sampled token that
 * sample_token left undecided, which the caller samples from its logits (still exact: a token a
 * trial accepts follows the softmax whichever trial it was, and so does a fresh draw from the
 * logits after every trial failed); returns the number of rows computed in fp32 (the candidates: a few per token), -1 where
 * scratch memory could not be had, -2 where the caller must compute the logits in full (a row of x
 * or a greedy candidate's logit not finite), -3 where the build has no vector code. */
int64_t screen_tokens(const float *x, int64_t ldx, int64_t num_tokens, const float *panels, const uint16_t *pairs,
                      const float *norm, const float *residual, int64_t n, int64_t k, const float *inv_temperature,
                      const double *uniforms, int64_t *trials, int64_t *out, int num_threads) {
#if !NATIVE
    (void)x; (void)ldx; (void)num_tokens; (void)panels; (void)pairs; (void)norm; (void)residual; (void)n; (void)k;
    (void)inv_temperature; (void)uniforms; (void)trials; (void)out; (void)num_threads;
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
    float *mass = inv_temperature ? malloc(sizeof(float) * (size_t)(num_tokens * num_panels)) : NULL;
    double *scratch = inv_temperature ? malloc(sizeof(double) * (size_t)(threads * 2 * num_panels)) : NULL;
    int64_t status = 0;
    if (!xp || !xt || !alpha || !beta || !upper || !lower || !best || !best_row ||
        (inv_temperature && (!mass || !scratch))) {
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
            const float r = EXACT_X ? v : from_bf16(h);
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
                           (float)(k + 16) * 0x1p-118f, upper, inv_temperature, mass};
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
                for (int64_t part = 0; part < GROUP; part += LARGE_PANELS)
                    for (int64_t t = 0; t < num_tokens; t += LARGE_TOKENS) {
                        const int64_t r = num_tokens - t < LARGE_TOKENS ? num_tokens - t : LARGE_TOKENS;
                        LARGE_TILES[r](&s, t, panel0 + part, my_lower + t);
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
            my_best[t] = -INFINITY;
            my_row[t] = -1;
            if (sampled(&s, t)) continue; /* sample_token's, below */
            float threshold = -INFINITY;
            for (int i = 0; i < nt; i++)
                if (lower[(int64_t)i * num_tokens + t] > threshold) threshold = lower[(int64_t)i * num_tokens + t];
            float top = -INFINITY;
            int64_t top_row = -1;
            for (int64_t p = p0; p < p1; p++) {
                if (upper[t * num_panels + p] < threshold) continue;
                float v[LANES];
                exact_panel(x + t * ldx, panels + p * k * LANES, k, v);
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
        if (trials) trials[t] = 0;
    }
    /* Sampled tokens: a token a thread at a time. */
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic) num_threads(threads) reduction(+ : exact_rows) if (inv_temperature)
#endif
    for (int64_t t = 0; t < num_tokens; t++) {
        if (!sampled(&s, t)) continue;
#ifdef _OPENMP
        double *my_scratch = scratch + (int64_t)omp_get_thread_num() * 2 * num_panels;
#else
        double *my_scratch = scratch;
#endif
        const int64_t rows = sample_token(&s, x + t * ldx, panels, t, uniforms + t * SAMPLE_TRIALS * 3, my_scratch,
                                          trials, out);
        if (rows < 0) {
            out[t] = -1; /* left to the caller, alone */
            if (trials) trials[t] = SAMPLE_TRIALS;
        } else {
            exact_rows += rows;
        }
    }
    status = exact_rows;
done:
    free(mass);
    free(scratch);
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

/* screen_tokens with every token greedy. */
int64_t greedy_screen(const float *x, int64_t ldx, int64_t num_tokens, const float *panels, const uint16_t *pairs,
                      const float *norm, const float *residual, int64_t n, int64_t k, int64_t *out, int num_threads) {
    return screen_tokens(x, ldx, num_tokens, panels, pairs, norm, residual, n, k, NULL, NULL, NULL, out, num_threads);
}

/* The most tokens a call is worth making with: AVX2's pass 1 costs the FMAs the fp32 product does
 * (no bf16 dot product), so past a few dozen rows the products are compute-bound and the screen
 * gains nothing (an AVX2 EPYC, Gemma 3's 262144 x 640 head: 0.83-1.04x the logits at 64 rows,
 * 0.9-1.6x at 32); on a Zen 1, whose FMA units are 128 bits wide, the products are compute-bound
 * from ~6 rows (the head at 8 rows 44.3 vs 44.0 ms, 16 rows 87.7 vs 79.4); the other paths gain at
 * every batch size. */
int64_t greedy_screen_max_tokens(void) {
#if NATIVE && !defined(__AVX512F__)
    __builtin_cpu_init();
    return __builtin_cpu_is("znver1") ? 8 : 32;
#else
    return INT64_MAX;
#endif
}

/* The uniform numbers a sampled token takes: 3 a trial. */
int64_t screen_sample_uniforms(void) { return 3 * SAMPLE_TRIALS; }
