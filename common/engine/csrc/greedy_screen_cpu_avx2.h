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

/* Fold one panel's approximate logits (rows 0-7 in a[0], 8-15 in a[1]) of one token into the
 * token's best lower bound and the panel's upper bound (rows past n count as -inf); as the AVX-512
 * fold: a logit whose approximation or bound overflowed sets no lower bound and sends its panel to
 * pass 2 whatever T is.  A sampled token's upper bounds go to fold_mass instead. */
static void fold(const screen_args *s, int64_t token, int64_t panel, const __m256 a[2], float *lower_max) {
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

/* R tokens (from token0) by P bf16 panels (from panel0): 2*R*P accumulators in registers (at most
 * 12 of the 16), each load of the weights feeding R tokens' FMAs.  One token takes 4 panels a
 * pass; more take one panel (in L1) at a time, up to 6 tokens a pass (on an AVX2 EPYC, 4 and 6
 * tokens of Gemma 3's head ran 1.8x and 1.3-1.45x the fp32 logits so, 1.37x and 0.91x in 2-token
 * passes of 2 panels). */
#define DEFINE_TILE(R, P)                                                                                  \
    static void tile_##R##_##P(const screen_args *s, int64_t token0, int64_t panel0, float *lower_max) {    \
        const int64_t k2 = s->k2;                                                                          \
        const float *xt = s->xt + token0 * 2 * k2;                                                         \
        __m256 acc[R][P][2];                                                                               \
        for (int r = 0; r < R; r++)                                                                        \
            for (int p = 0; p < P; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();                 \
        const uint16_t *base = s->pairs + panel0 * k2 * LANES * 2;                                         \
        for (int64_t i = 0; i < k2; i++) {                                                                 \
            for (int p = 0; p < P; p++) {                                                                  \
                const uint16_t *src = base + ((int64_t)p * k2 + i) * LANES * 2;                             \
                __builtin_prefetch(src + PREFETCH_AHEAD * LANES * 2);                                      \
                for (int h = 0; h < 2; h++) {                                                              \
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(src + 16 * h));                \
                    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));                    \
                    const __m256 odd = _mm256_castsi256_ps(wv);                                            \
                    for (int r = 0; r < R; r++) {                                                          \
                        const float *xr = xt + r * 2 * k2 + 2 * i;                                         \
                        acc[r][p][h] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr), acc[r][p][h]);       \
                        acc[r][p][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr + 1), acc[r][p][h]);    \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int p = 0; p < P; p++) fold(s, token0 + r, panel0 + p, acc[r][p], &lower_max[r]);         \
    }

#define SMALL_TOKENS 1
#define LARGE_TOKENS 6
#define LARGE_PANELS 1
DEFINE_TILE(1, 4)
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1) DEFINE_TILE(5, 1) DEFINE_TILE(6, 1)
static const tile_fn SMALL_TILES[SMALL_TOKENS + 1] = {0, tile_1_4};
static const tile_fn LARGE_TILES[LARGE_TOKENS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};

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
