/* The screen's AVX-512 code (included by greedy_screen_cpu.c, which has the bound and the layouts):
 * pass 1's tiles with AVX512-BF16's dot product where the CPU has it (else each bf16 pair widened
 * to two fp32 values), its AMX tiles, and pass 2's exact panel. */

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

/* Fold one panel's approximate logits `a` of one token into the token's best lower bound and the
 * panel's upper bound (rows past n count as -inf). */
static void fold(const screen_args *s, int64_t token, int64_t panel, __m512 a, float *lower_max) {
    const __m512 nrm = _mm512_loadu_ps(s->norm + panel * LANES), res = _mm512_loadu_ps(s->residual + panel * LANES);
    __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(s->alpha[token]), nrm,
                                   _mm512_fmadd_ps(_mm512_set1_ps(s->beta[token]), res, _mm512_set1_ps(s->tiny)));
    bound = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.01f), _mm512_mul_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-21f)));
    const int real_rows = panel_rows(s, panel);
    const __mmask16 valid = (__mmask16)((1u << real_rows) - 1u);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    /* A logit whose approximation overflowed (or a bound that did) says nothing: its panel is
     * computed in fp32 whatever T is, and it sets no lower bound. */
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_add_ps(a, bound)), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const float lo = hmax(_mm512_mask_sub_ps(neg_inf, valid & finite, a, bound));
    const float hi = (valid & ~finite) ? INFINITY : hmax(_mm512_mask_add_ps(neg_inf, valid, a, bound));
    if (sampled(s, token)) { /* its upper bounds go to fold_mass */
        float highs[LANES];
        _mm512_storeu_ps(highs, _mm512_add_ps(a, bound));
        fold_mass(s, token, panel, highs, real_rows, hi, (valid & ~finite) != 0);
        return;
    }
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

#define SMALL_TOKENS 4 /* up to this many tokens: tiles of GROUP panels, else of 2 panels */
#define LARGE_TOKENS 12
#define LARGE_PANELS 2
DEFINE_TILE(1, 4) DEFINE_TILE(2, 4) DEFINE_TILE(3, 4) DEFINE_TILE(4, 4)
DEFINE_TILE(1, 2) DEFINE_TILE(2, 2) DEFINE_TILE(3, 2) DEFINE_TILE(4, 2) DEFINE_TILE(5, 2) DEFINE_TILE(6, 2)
DEFINE_TILE(7, 2) DEFINE_TILE(8, 2) DEFINE_TILE(9, 2) DEFINE_TILE(10, 2) DEFINE_TILE(11, 2) DEFINE_TILE(12, 2)
static const tile_fn SMALL_TILES[SMALL_TOKENS + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4};
static const tile_fn LARGE_TILES[LARGE_TOKENS + 1] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2,
                                                      tile_7_2, tile_8_2, tile_9_2, tile_10_2, tile_11_2, tile_12_2};

#ifdef AMX
/* tmm0, tmm1: two panels' logits of 16 tokens (fp32); tmm2: the tokens' x~ (16 pairs of k);
 * tmm3, tmm4: the two panels' weights (16 pairs of k by 16 rows). */
static void amx_configure(void) {
    static const uint8_t rows[5] = {16, 16, 16, 16, 16};
    static const uint16_t colsb[5] = {64, 64, 64, 64, 64};
    amx_load_config(5, rows, colsb);
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

/* The fp32 logits of one panel's 16 rows for token x (K wide), into out: the product
 * panel_gemm_cpu.c computes, in its order (one fused multiply-add per k, k ascending). */
static inline void exact_panel(const float *x, const float *panel, int64_t k, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), _mm512_loadu_ps(panel + i * LANES), acc);
    _mm512_storeu_ps(out, acc);
}
