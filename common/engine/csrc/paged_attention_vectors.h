/* The vector path's pieces for paged_attention_cpu.c (its only includer, after its MAX_GROUP and
 * bf16_t): the vector width, loads of fp32, bf16 and fp8 cache rows (a bf16 row on AVX-512 BW in pairs
 * of vectors from one load), lane sums, and pass 3's weighing of a tile's value rows. */
#ifndef PAGED_ATTENTION_VECTORS_H
#define PAGED_ATTENTION_VECTORS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fp8_e4m3.h"
#include "vec16.h"

#if defined(__AVX512F__)
#define VL 16
#define VECTOR_REGISTERS 32
#else
#define VL 8
#define VECTOR_REGISTERS 16
#endif
#define TILE_KEYS 16

typedef float vecw __attribute__((vector_size(VL * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

static inline int value_chunk(int group) {
    const int c = VECTOR_REGISTERS / 2 / group;
    return c < 1 ? 1 : c > 8 ? 8 : c;
}

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* VL fp8 e4m3 codes widened to their values / FP8_ROW_UNIT: a code's 7 magnitude bits in an fp16's
 * bits 13-7 and its sign in bit 15 make the fp16 of its value / 256 (fp16's exponent bias is 8 more
 * than e4m3's and its mantissa 7 bits wider, so e4m3's subnormals land on fp16's), which F16C widens
 * exactly.  The code sign-extended to 16 bits and shifted by 7 has them there, and its sign in bit
 * 14 too, which the mask clears; a NaN code (magnitude 0x7F: 0x3F80 there) is given fp16's all-ones
 * exponent, a NaN.  Without F16C, the table.  The attention's vector path takes the rows so, the unit
 * folded into its scale and its softmax's sum (a power of two: exact unless a product or a partial
 * sum falls below fp32's normal range, ~1e-36); load_row gives the values. */
#define FP8_ROW_UNIT 256.0f
#define FP8_HALF_MASK ((short)0xBF80)      /* the fp16's sign, exponent and top 3 mantissa bits */
#define FP8_HALF_MAGNITUDE ((short)0x3F80) /* its exponent and mantissa bits: all set for the NaN codes */
#define FP8_HALF_NAN_BITS ((short)0x7C00)  /* fp16's exponent: all ones with a mantissa is a NaN */
static inline __attribute__((always_inline)) vecw load_fp8_row(const uint8_t *src) {
    vecw v;
#if defined(__F16C__) && VL == 16
    const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(codes, 7), _mm256_set1_epi16(FP8_HALF_MASK));
    const __m256i magnitude = _mm256_set1_epi16(FP8_HALF_MAGNITUDE);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(halves, magnitude), magnitude);
    const __m256i nan_bits = _mm256_and_si256(nan, _mm256_set1_epi16(FP8_HALF_NAN_BITS));
    const __m512 wide = _mm512_cvtph_ps(_mm256_or_si256(halves, nan_bits));
    memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
    const __m128i codes = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)src));
    const __m128i halves = _mm_and_si128(_mm_slli_epi16(codes, 7), _mm_set1_epi16(FP8_HALF_MASK));
    const __m128i magnitude = _mm_set1_epi16(FP8_HALF_MAGNITUDE);
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(halves, magnitude), magnitude);
    const __m128i nan_bits = _mm_and_si128(nan, _mm_set1_epi16(FP8_HALF_NAN_BITS));
    const __m256 wide = _mm256_cvtph_ps(_mm_or_si128(halves, nan_bits));
    memcpy(&v, &wide, sizeof v);
#else
    for (int i = 0; i < VL; i++) v[i] = fp8_e4m3_to_f32(src[i]) / FP8_ROW_UNIT;
#endif
    return v;
}

/* The factor a row of elem bytes a value is read in by load_unit_row: FP8_ROW_UNIT for fp8, else 1. */
static inline __attribute__((always_inline)) float row_unit(int elem) { return elem == 1 ? FP8_ROW_UNIT : 1.0f; }

/* VL values of a row from index on, divided by row_unit(elem): elem 4 fp32, 2 bf16, 1 fp8 e4m3. */
static inline __attribute__((always_inline)) vecw load_unit_row(const void *base, int64_t index, int elem) {
    vecw v;
    if (elem == 4) {
        memcpy(&v, (const float *)base + index, sizeof v);
    } else if (elem == 1) {
        v = load_fp8_row((const uint8_t *)base + index);
    } else {
        typedef uint16_t halves __attribute__((vector_size(VL * sizeof(uint16_t))));
        typedef uint32_t words __attribute__((vector_size(VL * sizeof(uint32_t))));
        halves h;
        memcpy(&h, (const bf16_t *)base + index, sizeof h);
        v = (vecw)(__builtin_convertvector(h, words) << 16);
    }
    return v;
}

/* VL values of a row from index on, as they are (elem 4 fp32, 2 bf16, 1 fp8 e4m3). */
static inline __attribute__((always_inline)) vecw load_row(const void *base, int64_t index, int elem) {
    const vecw v = load_unit_row(base, index, elem);
    return elem == 1 ? v * FP8_ROW_UNIT : v;
}

/* A bf16 cache on AVX-512 (BW): 32 values a load, widened by interleaving zero halves in (one
 * unpack each for 16 values, against a widening move and a shift) -- which leaves them permuted
 * within the 32: the low vector holds values {0-3, 8-11, 16-19, 24-27}, the high one {4-7, 12-15,
 * 20-23, 28-31}.  Pass 1 takes the query in the same order (the scores are sums over every value:
 * the order is theirs to choose), pass 3 accumulates the values so and puts them back in order at
 * the end.  Rows of head_dim a multiple of 32. */
#if VL == 16 && defined(__AVX512BW__)
#include <immintrin.h>
#define PAIRED_BF16 1
static inline __attribute__((always_inline)) void load_pair(const void *base, int64_t index, vecw *lo, vecw *hi) {
    const __m512i raw = _mm512_loadu_si512((const void *)((const bf16_t *)base + index));
    const __m512 l = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), raw));
    const __m512 h = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), raw));
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
}

/* 32 values in order (a, b: the first and second 16) into load_pair's order (lo, hi), and back. */
static inline __attribute__((always_inline)) void pair_order(vecw a, vecw b, vecw *lo, vecw *hi) {
    __m512 x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    const __m512 l = _mm512_permutex2var_ps(
        x, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), y);
    const __m512 h = _mm512_permutex2var_ps(
        x, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), y);
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
}

static inline __attribute__((always_inline)) void natural_order(float *row) {
    __m512 lo = _mm512_loadu_ps(row), hi = _mm512_loadu_ps(row + 16);
    _mm512_storeu_ps(row, _mm512_permutex2var_ps(
        lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi));
    _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(
        lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi));
}
#else
#define PAIRED_BF16 0
#endif

/* The sum of v's lanes, halving (the halves by memcpy: GCC 11 has no __builtin_shufflevector). */
static inline __attribute__((always_inline)) float sum_lanes(vecw v) {
    vec8 a;
#if VL == 16
    vec8 high;
    memcpy(&a, &v, sizeof a);
    memcpy(&high, (const float *)&v + 8, sizeof high);
    a += high;
#else
    a = v;
#endif
    vec4 b, upper;
    memcpy(&b, &a, sizeof b);
    memcpy(&upper, (const float *)&a + 4, sizeof upper);
    b += upper;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((always_inline)) float sum16(vec16 v) {
    float total = 0.0f;
    for (int i = 0; i < 16; i += VL) {
        vecw part;
        memcpy(&part, (const float *)&v + i, sizeof part);
        total += sum_lanes(part);
    }
    return total;
}

/* sc[0 .. n) (n >= 1) into their softmax's numerators e^(sc - max) in place, 16 at a time (the
 * lanes past n count nothing); returns 1 / their sum. */
static inline __attribute__((always_inline)) float softmax_weights(float *sc, int n) {
    const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vec16 top = (vec16){0} - INFINITY;
    for (int j = 0; j < n; j += 16) {
        const int left = n - j;
        vec16 v = (vec16){0} - INFINITY;
        memcpy(&v, sc + j, sizeof(float) * (left < 16 ? left : 16));
        const ivec16 above = v > top;
        top = (vec16)((above & (ivec16)v) | (~above & (ivec16)top));
    }
    float m = top[0];
    for (int l = 1; l < 16; l++) m = top[l] > m ? top[l] : m;
    vec16 sum = {0};
    for (int j = 0; j < n; j += 16) {
        const int left = n - j;
        vec16 v = {0};
        memcpy(&v, sc + j, sizeof(float) * (left < 16 ? left : 16));
        const vec16 e = (vec16)((ivec16)exp_nonpositive(v - m) & (lane < left));
        memcpy(sc + j, &e, sizeof(float) * (left < 16 ? left : 16));
        sum += e;
    }
    return 1.0f / sum16(sum);
}

/* acc[g][d .. d + VL C) += sum over the tile's keys t of weights[g n_keys + t] * V_t[d .. d + VL C)
 * / row_unit(cache_elem) (V_t's row at off[t]; G x C accumulators in registers over the tile). */
static inline __attribute__((always_inline)) void weigh_values(const int cache_elem, const int paired, const int G,
                                                               const int C, const void *v_cache, const int64_t *off,
                                                               int d, int tile, const float *weights, int n_keys,
                                                               float *acc, int head_dim) {
    vecw a[MAX_GROUP][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) memcpy(&a[g][c], acc + (int64_t)g * head_dim + d + VL * c, sizeof(vecw));
    for (int t = 0; t < tile; t++) {
        vecw w[MAX_GROUP];
        for (int g = 0; g < G; g++) w[g] = (vecw){0} + weights[(int64_t)g * n_keys + t];
#if PAIRED_BF16
        if (paired) { /* C even: pairs of vectors from one load each (their values permuted: see load_pair) */
            for (int c = 0; c < C; c += 2) {
                vecw lo, hi;
                load_pair(v_cache, off[t] + d + VL * c, &lo, &hi);
                for (int g = 0; g < G; g++) a[g][c] += w[g] * lo, a[g][c + 1] += w[g] * hi;
            }
            continue;
        }
#endif
        for (int c = 0; c < C; c++) {
            const vecw vv = load_unit_row(v_cache, off[t] + d + VL * c, cache_elem);
            for (int g = 0; g < G; g++) a[g][c] += w[g] * vv;
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) memcpy(acc + (int64_t)g * head_dim + d + VL * c, &a[g][c], sizeof(vecw));
}
#endif
