/* Prompt chunks in tiles of query rows, for paged_attention_cpu.c (its only includer, after
 * paged_attention_vectors.h, key_offset and bf16_t).
 *
 * Why: the item path attends one query token at a time, so every key row it loads feeds only that
 * token's G heads, and each (head, key) score ends in a sum of a vector's lanes; a prompt chunk of
 * n tokens reads its keys n times that way and runs at about a third of the FMA peak.  Here a unit is
 * a tile of up to TILE_ROWS query rows (TILE_ROWS / G consecutive tokens by their G heads), and both
 * products are small matrix products with register tiles of TILE_RC rows:
 *   pass 1  S[row][key] = scale * sum_d Q[row][d] K[key][d], over TILE_KC vectors of keys at a time
 *           from the request's keys transposed once into Kt[d][key] (the call's first phase, shared
 *           by all its tiles), each query value broadcast to them;
 *   pass 2  each row's softmax over its own visible keys (the causal edge and a window's), the others
 *           weighted 0;
 *   pass 3  O[row][d] = sum_key W[row][key] V[key][d] / sum, over TILE_KC vectors of d at a time,
 *           reading an fp32 cache's value rows in place through the block table, a bf16 (fp8) cache's from
 *           fp32 rows they were widened into once in the first phase (widening them in every tile of
 *           rows and dims instead: 8 prompts of 256 / 512 tokens 1.14 / 1.18x slower; gathering an
 *           fp32 cache's rows too: 0.94-0.99x).
 * The arithmetic is fp32 as on the item path (the same two-pass softmax and exp); only the order of
 * the sums differs.  Taken by chunks of TILE_MIN_TOKENS or more new tokens that see TILE_MIN_KEYS
 * keys or more and at most TILE_MAX_KEYS (the transposed keys and a tile's scores are scratch of
 * that length). */
#ifndef PAGED_ATTENTION_TILES_H
#define PAGED_ATTENTION_TILES_H

#if VL == 16
#define TILE_RC 6 /* query rows a register tile: 6 x 4 accumulators, 4 loaded vectors, a broadcast */
#define TILE_KC 4 /* vectors of keys (pass 1) or of values' dims (pass 3) a register tile */
#else
#define TILE_RC 4 /* AVX2's 16 registers: 4 x 2 accumulators */
#define TILE_KC 2
#endif
#define TILE_ROWS 24        /* query rows a unit, at most (tokens x G) */
/* A chunk of fewer new tokens, or that sees fewer keys, stays on the item path: 8 fresh prompts of L
 * tokens, Gemma 3 270M's layout (4 heads on a KV head of 256), a Xeon with AVX-512, the tiles
 * against the item path: L = 16 0.51x, 32 0.81x, 64 1.07x, 128 1.16x, 256 1.55-1.60x, 512 1.64x
 * (short rows waste most of a tile of 64 keys, and the transposition is not repaid). */
#define TILE_MIN_TOKENS 16
#define TILE_MIN_KEYS 64
#define TILE_MAX_KEYS 16384 /* keys a tiled chunk sees, at most */
#define TILE_KEY_STEP (TILE_KC * VL)

#include <immintrin.h>

/* x in every lane: one broadcast (`(vecw){0} + x` costs an add first: 0 + -0 is +0). */
static inline __attribute__((always_inline)) vecw splat(float x) {
#if VL == 16
    const __m512 v = _mm512_set1_ps(x);
#else
    const __m256 v = _mm256_set1_ps(x);
#endif
    vecw r;
    memcpy(&r, &v, sizeof r);
    return r;
}

/* Keys [kf, kf + n) of one KV head transposed into kt[d * stride + j] (fp32; the pad up to stride,
 * a multiple of 16, zeros), 16 keys at a time (each dim's 16 values one store); with vc (a bf16 or
 * fp8 cache), their value rows widened into vc[j * head_dim + d]; with voff, where pass 3 finds value
 * row j: its offset in the cache without the head's (fp32) or in vc (bf16, fp8). */
static void gather_keys(const void *k_cache, const void *v_cache, int cache_elem, int64_t s_block, int64_t s_slot,
                        int64_t s_head, const int32_t *blocks, int block_size, int kv_head, int kf, int n, int head_dim,
                        float *kt, int stride, float *vc, int64_t *voff) {
    for (int j0 = 0; j0 < stride; j0 += 16) {
        int64_t off[16];
        for (int t = 0; t < 16; t++) {
            off[t] = j0 + t < n ? key_offset(blocks, kf + j0 + t, block_size, s_block, s_slot, s_head, kv_head) : -1;
            if (voff && j0 + t < n)
                voff[j0 + t] = vc ? (int64_t)(j0 + t) * head_dim : off[t] - (int64_t)kv_head * s_head;
        }
        for (int d = 0; d < head_dim; d++) {
            float column[16];
            for (int t = 0; t < 16; t++)
                column[t] = off[t] < 0 ? 0.0f
                            : cache_elem == 4 ? ((const float *)k_cache)[off[t] + d]
                            : cache_elem == 2 ? bf16_to_f32(((const bf16_t *)k_cache)[off[t] + d])
                                              : fp8_e4m3_to_f32(((const uint8_t *)k_cache)[off[t] + d]);
            memcpy(kt + (int64_t)d * stride + j0, column, sizeof column);
        }
        for (int t = 0; vc && t < 16 && off[t] >= 0; t++)
            for (int d = 0; d < head_dim; d += VL) {
                const vecw v = load_row(v_cache, off[t] + d, cache_elem);
                memcpy(vc + (int64_t)(j0 + t) * head_dim + d, &v, sizeof v);
            }
    }
}

/* Pass 1 for R rows of qs (row stride head_dim) and the key vectors from jb: s[r * stride + jb ...]. */
static inline __attribute__((always_inline)) void score_tile(const int R, const float *qs, int head_dim,
                                                             const float *kt, int stride, int jb, float scale,
                                                             float *s) {
    vecw acc[TILE_RC][TILE_KC]; /* in registers: every loop over them unrolled */
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < TILE_KC; c++) acc[r][c] = (vecw){0};
    for (int d = 0; d < head_dim; d++) {
        vecw kv[TILE_KC];
        _Pragma("GCC unroll 8") for (int c = 0; c < TILE_KC; c++)
            memcpy(&kv[c], kt + (int64_t)d * stride + jb + VL * c, sizeof(vecw));
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            const vecw q = splat(qs[(int64_t)r * head_dim + d]);
            _Pragma("GCC unroll 8") for (int c = 0; c < TILE_KC; c++) acc[r][c] += q * kv[c];
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < TILE_KC; c++) {
            const vecw v = acc[r][c] * scale;
            memcpy(s + (int64_t)r * stride + jb + VL * c, &v, sizeof v);
        }
}

/* Pass 3 for R rows of weights w (row stride) over the fp32 value rows v + voff[j] of keys [j0, j1)
 * and C vectors of dims from d0: acc[r][c] (into o, row stride head_dim). */
static inline __attribute__((always_inline)) void value_tile(const int R, const int C, const float *v,
                                                             const int64_t *voff, const float *w, int stride, int j0,
                                                             int j1, int d0, float *o, int head_dim) {
    vecw acc[TILE_RC][TILE_KC]; /* in registers: every loop over them unrolled */
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = (vecw){0};
    for (int j = j0; j < j1; j++) {
        vecw vv[TILE_KC];
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)
            memcpy(&vv[c], v + voff[j] + d0 + VL * c, sizeof(vecw));
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            const vecw x = splat(w[(int64_t)r * stride + j]);
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] += x * vv[c];
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)
            memcpy(o + (int64_t)r * head_dim + d0 + VL * c, &acc[r][c], sizeof(vecw));
}

#define TILE_ROW_CASES(X) X(1) X(2) X(3) X(4) X(5) X(6)

static void score_rows(int R, const float *qs, int head_dim, const float *kt, int stride, int jb, float scale,
                       float *s) {
#define SCORE_CASE(N) if (R == N && N <= TILE_RC) { score_tile(N, qs, head_dim, kt, stride, jb, scale, s); return; }
    TILE_ROW_CASES(SCORE_CASE)
#undef SCORE_CASE
}

static void value_rows(int R, int C, const float *v, const int64_t *voff, const float *w, int stride, int j0, int j1,
                       int d0, float *o, int head_dim) {
#define VALUE_CASE(N)                                                                                        \
    if (R == N && N <= TILE_RC) {                                                                            \
        if (C == TILE_KC) value_tile(N, TILE_KC, v, voff, w, stride, j0, j1, d0, o, head_dim);               \
        else                                                                                                 \
            for (int c = 0; c < C; c++) value_tile(N, 1, v, voff, w, stride, j0, j1, d0 + VL * c, o, head_dim); \
        return;                                                                                              \
    }
    TILE_ROW_CASES(VALUE_CASE)
#undef VALUE_CASE
}

/* What every unit of a call shares: the queries and output (as paged_attention takes them), the
 * element sizes, the heads, the window and the scale. */
typedef struct {
    const void *q;
    int64_t q_stride_t, q_stride_h;
    void *out;
    int elem, cache_elem, num_heads, head_dim, group, window;
    float scale;
} tile_call;

/* One unit: tokens [tq0, tq0 + nt) of a chunk whose keys start at kf (kt: its keys transposed,
 * stride keys a dim; value row j at v + voff[j], fp32), the chunk's first new token at position
 * pos0 and packed row t0; row i is token tq0 + i / G, head kv_head * G + i % G.  Scratch: qs
 * (TILE_ROWS x head_dim), s (TILE_ROWS x stride), o (TILE_ROWS x head_dim). */
static void attend_tile(const tile_call *c, int kv_head, int kf, const float *kt, const float *v, const int64_t *voff,
                        int stride, int t0, int pos0, int tq0, int nt, float *qs, float *s, float *o) {
    const int G = c->group, D = c->head_dim, rows = nt * G;
    if (rows <= 0) return;
    int lo[TILE_ROWS], hi[TILE_ROWS]; /* each row's visible keys, [lo, hi] relative to kf */
    for (int i = 0; i < rows; i++) {
        const int t = tq0 + i / G, h = kv_head * G + i % G, pos = pos0 + t;
        const int64_t q_at = (int64_t)(t0 + t) * c->q_stride_t + (int64_t)h * c->q_stride_h;
        const char *src = (const char *)c->q + q_at * c->elem;
        for (int d = 0; d < D; d += VL) {
            const vecw v = load_row(src, d, c->elem);
            memcpy(qs + (int64_t)i * D + d, &v, sizeof v);
        }
        const int first = c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
        lo[i] = first - kf;
        hi[i] = pos - kf;
    }
    const int j_lo = lo[0] - lo[0] % TILE_KEY_STEP, j_end = hi[rows - 1] + 1; /* keys the unit computes */
    /* pass 1 */
    for (int r0 = 0; r0 < rows; r0 += TILE_RC) {
        const int R = rows - r0 < TILE_RC ? rows - r0 : TILE_RC;
        for (int jb = j_lo; jb < j_end; jb += TILE_KEY_STEP)
            score_rows(R, qs + (int64_t)r0 * D, D, kt, stride, jb, c->scale, s + (int64_t)r0 * stride);
    }
    /* pass 2: each row's weights over its visible keys, 0 for the rest of [lo[0], j_end) */
    float inv_sum[TILE_ROWS];
    for (int i = 0; i < rows; i++) {
        float *sc = s + (int64_t)i * stride;
        inv_sum[i] = softmax_weights(sc + lo[i], hi[i] - lo[i] + 1);
        for (int j = lo[0]; j < lo[i]; j++) sc[j] = 0.0f;
        for (int j = hi[i] + 1; j < j_end; j++) sc[j] = 0.0f;
    }
    /* pass 3 */
    for (int r0 = 0; r0 < rows; r0 += TILE_RC) {
        const int R = rows - r0 < TILE_RC ? rows - r0 : TILE_RC;
        for (int d0 = 0; d0 < D; d0 += TILE_KC * VL) {
            const int C = (D - d0) / VL < TILE_KC ? (D - d0) / VL : TILE_KC;
            value_rows(R, C, v, voff, s + (int64_t)r0 * stride, stride, lo[0], j_end, d0, o + (int64_t)r0 * D, D);
        }
    }
    for (int i = 0; i < rows; i++) {
        const int t = tq0 + i / G, h = kv_head * G + i % G;
        char *out_row = (char *)c->out + (int64_t)(t0 + t) * c->num_heads * D * c->elem;
        write_heads(c->elem, out_row, o + (int64_t)i * D, inv_sum + i, h, 1, D);
    }
}
#endif
