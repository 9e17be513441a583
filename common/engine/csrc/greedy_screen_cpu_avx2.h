/* The screen's AVX2 code (included by greedy_screen_cpu.c, which has the bound and the layouts).
 * There is no bf16 dot product: a 256-bit load holds two k of 8 rows as pairs of 16 bits (low half
 * the even k's bf16); shifting each pair left by 16 gives the even k's copy as an fp32, and the
 * pair itself is the odd k's copy (ODD_TAKES_PAIR: its high half was chosen for that at packing).
 * fp32 FMAs multiply them by x itself (EXACT_X); the bound's g term covers the sums, in any order.
 * A panel's 16 rows are two 8-lane vectors. */

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Fold one panel's approximate logits (rows 0-7 in rows_lo, 8-15 in rows_hi) of one token into the
 * token's best lower bound and the panel's upper bound (rows past n count as -inf); as the AVX-512
 * fold: a logit whose approximation or bound overflowed sets no lower bound and sends its panel to
 * pass 2 whatever T is.  A sampled token's upper bounds go to fold_mass instead. */
static void fold(const screen_args *s, int64_t token, int64_t panel, __m256 rows_lo, __m256 rows_hi, float *lower_max) {
    const __m256 a[2] = {rows_lo, rows_hi};
    const __m256 alpha = _mm256_set1_ps(s->alpha[token]), beta = _mm256_set1_ps(s->beta[token]);
    const __m256 tiny = _mm256_set1_ps(s->tiny), widen = _mm256_set1_ps(1.01f), relative = _mm256_set1_ps(0x1p-21f);
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY), neg_inf = _mm256_set1_ps(-INFINITY);
    const int64_t first = panel * LANES;
    const int real_rows = panel_rows(s, panel);
    const __m256i real = _mm256_set1_epi32(real_rows);
    float lo = -INFINITY, hi = -INFINITY, highs[LANES];
    int overflowed = 0;
    for (int h = 0; h < 2; h++) {
        const __m256 nrm = _mm256_loadu_ps(s->norm + first + 8 * h), res = _mm256_loadu_ps(s->residual + first + 8 * h);
        __m256 bound = _mm256_fmadd_ps(alpha, nrm, _mm256_fmadd_ps(beta, res, tiny));
        bound = _mm256_fmadd_ps(bound, widen, _mm256_mul_ps(_mm256_andnot_ps(sign, a[h]), relative));
        const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(8 * h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(real, lane));
        const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_add_ps(a[h], bound)), inf, _CMP_LT_OQ);
        _mm256_storeu_ps(highs + 8 * h, _mm256_add_ps(a[h], bound));
        const float lo_h = hmax8(_mm256_blendv_ps(neg_inf, _mm256_sub_ps(a[h], bound), _mm256_and_ps(valid, finite)));
        const float hi_h = hmax8(_mm256_blendv_ps(neg_inf, _mm256_add_ps(a[h], bound), _mm256_and_ps(valid, finite)));
        if (lo_h > lo) lo = lo_h;
        if (hi_h > hi) hi = hi_h;
        overflowed |= _mm256_movemask_ps(_mm256_andnot_ps(finite, valid));
    }
    if (sampled(s, token)) {
        fold_mass(s, token, panel, highs, real_rows, hi, overflowed);
        return;
    }
    if (lo > *lower_max) *lower_max = lo;
    s->upper[token * s->num_panels + panel] = overflowed ? INFINITY : hi;
}

/* The bf16 pairs at src (one k-pair of a panel: 16 rows x 2 k) widened: even/odd k of rows 0-7
 * and 8-15. */
#define WIDEN(src)                                                                                         \
    const __m256i w0_ = _mm256_loadu_si256((const __m256i *)(src));                                        \
    const __m256i w1_ = _mm256_loadu_si256((const __m256i *)((src) + 16));                                 \
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0_, 16)), odd0 = _mm256_castsi256_ps(w0_); \
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1_, 16)), odd1 = _mm256_castsi256_ps(w1_)

/* One token's k-pair (x_even, x_odd at xr) into a panel's two accumulators lo, hi. */
#define ACCUMULATE(xr, lo, hi)                                                                             \
    do {                                                                                                   \
        const __m256 x_even = _mm256_broadcast_ss(xr), x_odd = _mm256_broadcast_ss((xr) + 1);              \
        lo = _mm256_fmadd_ps(even0, x_even, lo);                                                           \
        lo = _mm256_fmadd_ps(odd0, x_odd, lo);                                                             \
        hi = _mm256_fmadd_ps(even1, x_even, hi);                                                           \
        hi = _mm256_fmadd_ps(odd1, x_odd, hi);                                                             \
    } while (0)

/* R (1-4) tokens from token0 over one bf16 panel (in L1), each load of its weights feeding R
 * tokens' FMAs: 2R accumulators beside the panel's 4 widened vectors and a token's 2 broadcasts.
 * The accumulators are named variables, not an array: GCC 12 kept an array of them in memory and
 * stored every one at every k.  On a Zen 1 (Gemma 3's head, 2 threads) that took 8 rows 61 -> 44 ms
 * and 16 rows 120 -> 88 ms (the fp32 logits: 44 and 79), 4 rows 31 -> 23; the tokens the same. */
static inline __attribute__((always_inline)) void tile_tokens(const screen_args *s, int64_t token0, int64_t panel0,
                                                              float *lower_max, const int R) {
    const int64_t k2 = s->k2;
    const float *xt = s->xt + token0 * 2 * k2;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    const uint16_t *src = s->pairs + panel0 * k2 * LANES * 2;
    for (int64_t i = 0; i < k2; i++, src += LANES * 2) {
        __builtin_prefetch(src + PREFETCH_AHEAD * LANES * 2);
        WIDEN(src);
        const float *xr = xt + 2 * i;
        ACCUMULATE(xr, a0, b0);
        if (R > 1) ACCUMULATE(xr + 2 * k2, a1, b1);
        if (R > 2) ACCUMULATE(xr + 4 * k2, a2, b2);
        if (R > 3) ACCUMULATE(xr + 6 * k2, a3, b3);
    }
    fold(s, token0, panel0, a0, b0, &lower_max[0]);
    if (R > 1) fold(s, token0 + 1, panel0, a1, b1, &lower_max[1]);
    if (R > 2) fold(s, token0 + 2, panel0, a2, b2, &lower_max[2]);
    if (R > 3) fold(s, token0 + 3, panel0, a3, b3, &lower_max[3]);
}

static void tile_1_1(const screen_args *s, int64_t t, int64_t p, float *m) { tile_tokens(s, t, p, m, 1); }
static void tile_2_1(const screen_args *s, int64_t t, int64_t p, float *m) { tile_tokens(s, t, p, m, 2); }
static void tile_3_1(const screen_args *s, int64_t t, int64_t p, float *m) { tile_tokens(s, t, p, m, 3); }
static void tile_4_1(const screen_args *s, int64_t t, int64_t p, float *m) { tile_tokens(s, t, p, m, 4); }

/* One token over 4 panels a pass (the weights stream from memory: 4 panels' loads in flight). */
static void tile_1_4(const screen_args *s, int64_t token0, int64_t panel0, float *lower_max) {
    const int64_t k2 = s->k2;
    const float *xt = s->xt + token0 * 2 * k2;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    const uint16_t *base = s->pairs + panel0 * k2 * LANES * 2;
    const int64_t panel_step = k2 * LANES * 2;
    for (int64_t i = 0; i < k2; i++) {
        const uint16_t *src = base + i * LANES * 2;
        const float *xr = xt + 2 * i;
        for (int p = 0; p < 4; p++) __builtin_prefetch(src + p * panel_step + PREFETCH_AHEAD * LANES * 2);
        {
            WIDEN(src);
            ACCUMULATE(xr, a0, b0);
        }
        {
            WIDEN(src + panel_step);
            ACCUMULATE(xr, a1, b1);
        }
        {
            WIDEN(src + 2 * panel_step);
            ACCUMULATE(xr, a2, b2);
        }
        {
            WIDEN(src + 3 * panel_step);
            ACCUMULATE(xr, a3, b3);
        }
    }
    fold(s, token0, panel0, a0, b0, lower_max);
    fold(s, token0, panel0 + 1, a1, b1, lower_max);
    fold(s, token0, panel0 + 2, a2, b2, lower_max);
    fold(s, token0, panel0 + 3, a3, b3, lower_max);
}

#define SMALL_TOKENS 1
#define LARGE_TOKENS 4
#define LARGE_PANELS 1
static const tile_fn SMALL_TILES[SMALL_TOKENS + 1] = {0, tile_1_4};
static const tile_fn LARGE_TILES[LARGE_TOKENS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};

/* The fp32 logits of one panel's 16 rows for token x (K wide), into out: the product
 * panel_gemm_cpu.c computes, in its order (one fused multiply-add per k, k ascending, each of the
 * panel's two vectors). */
static inline void exact_panel(const float *x, const float *panel, int64_t k, float *out) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 xi = _mm256_set1_ps(x[i]);
        lo = _mm256_fmadd_ps(xi, _mm256_loadu_ps(panel + i * LANES), lo);
        hi = _mm256_fmadd_ps(xi, _mm256_loadu_ps(panel + i * LANES + 8), hi);
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
}
