/* What the AVX512-VNNI products (int8_vnni_cpu.c, int4_vnni_cpu.c) share: the activations'
 * quantization -- per row and group of ``group`` inputs, symmetric, xq = round(x * 127 / amax), scale
 * amax / 127 -- and the driver that splits blocks of 16 output channels among OpenMP threads (chunks
 * of CHUNK blocks over blocks of ROW_BLOCK rows; within them a kernel's passes, 8 rows by one block
 * on the VNNI tiles).  Included only where __AVX512VNNI__. */
#ifndef VNNI_ROWS_H
#define VNNI_ROWS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vnni_shared.h"

#define ROWS 8   /* rows a pass over a block */
/* Rows a thread runs through a chunk of blocks before the next chunk: the threads take (row block,
 * chunk) pairs, so a large product's output is written a block of rows at a time (its rows are
 * n_out floats apart: 2048 rows of a 4096-wide output touch 8192 pages for every chunk when one
 * chunk runs over all of them) and its quantized rows are read from L2.  The layers' four products
 * alone (a Xeon with AMX, two builds interleaved): 2048 rows 1.35x, 512 rows 1.08x, 64 rows and
 * fewer unchanged (one block of rows: the split among threads is the chunks' as before). */
#define ROW_BLOCK 128
/* The weight bytes ahead that the tiles prefetch, into which cache, and from how many rows.  On a Zen
 * 4, tiles of 5-8 rows 2 KB into L1: with 8 dpbusd a cache line the hardware prefetchers alone fall
 * behind (an A/B in one process: 8 rows through the int8 LM head 5.9 -> 5.1 ms, the layers' products
 * -10%); with 1-4 rows they keep up, and prefetching costs.  On Intel cores with AMX (where the AMX
 * tiles take 5 and more rows of int8), every row count 16 KB into L2: builds side by side on a
 * Sapphire Rapids-class VM, the int8 LM head's greedy tokens at 1 / 2 / 4 rows 6.1 / 6.9 / 9.2 ->
 * 4.9 / 4.7 / 5.9 ms (2 KB into L1 at every row count: 5.4 / 5.7 / 7.0), a 64 MB int4 weight at 1
 * / 4 rows 2.9 / 4.3 -> 2.0 / 2.4 ms; one-row decode steps (two processes alternating) int8 12.8-13.2
 * -> 11.6-12.0 ms, int4 13.5-13.6 -> 11.5-12.5 ms.  On a Zen 5 (told from a Zen 4 by AVX512-VP2INTERSECT,
 * which GCC 12's -march=native reports for it while naming it a Zen 3; Intel's Tiger Lake has it too)
 * the same: four builds interleaved in one process (~49 GB/s read), the int8 LM head's greedy tokens
 * at 4 / 8 rows 3.63 / 3.25 -> 3.08 / 3.00 ms, 18 layers' int8 qkv and gate_up at 1 / 4 / 8 rows 1.25 /
 * 1.38 / 1.55 -> 1.14 / 1.28 / 1.37 ms (8 KB ahead: the same; 32 KB: slower at 8 rows); the int4
 * layers' products unchanged. */
#if defined(__AMX_TILE__) || defined(__AVX512VP2INTERSECT__)
#define PREFETCH_BYTES 16384
#define PREFETCH_HINT _MM_HINT_T1
#define PREFETCH_MIN_ROWS 1
#else
#define PREFETCH_BYTES 2048
#define PREFETCH_HINT _MM_HINT_T0
#define PREFETCH_MIN_ROWS 5
#endif
/* A tile of MR rows starts loading the weight bytes PREFETCH_BYTES past p. */
#define PREFETCH_WEIGHT(MR, p)                                                                      \
    do {                                                                                            \
        if ((MR) >= PREFETCH_MIN_ROWS) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, PREFETCH_HINT); \
    } while (0)

/* Rows [rows, k_in] of x into xq [rows, k_pad] (int8, the pad zero), xs [rows, groups] (the groups'
 * scales), sums [rows, groups] (each group's sum of xq) and x_sums (each group's sum of x, fp32). */
static void quantize_rows(const float *x, int64_t rows, int64_t k_in, int64_t k_pad, int64_t group, int8_t *xq,
                          float *xs, int32_t *sums, float *x_sums) {
    int64_t groups = (k_pad + group - 1) / group;
#pragma omp parallel for schedule(static) if (rows * k_pad >= PARALLEL_MIN)
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * k_in;
        int8_t *qm = xq + m * k_pad;
        memset(qm, 0, (size_t)k_pad);
        for (int64_t g = 0; g < groups; g++) {
            int64_t start = g * group, len = k_in - start < group ? k_in - start : group;
            __m512 top = _mm512_setzero_ps(), total = _mm512_setzero_ps();
            for (int64_t j = 0; j < len; j += 16) {
                __mmask16 mask = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
                __m512 v = _mm512_maskz_loadu_ps(mask, xm + start + j);
                top = _mm512_max_ps(top, _mm512_abs_ps(v));
                total = _mm512_add_ps(total, v);
            }
            float amax = len > 0 ? _mm512_reduce_max_ps(top) : 0.0f;
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512i sum = _mm512_setzero_si512();
            for (int64_t j = 0; j < len; j += 16) {
                __mmask16 mask = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xm + start + j), _mm512_set1_ps(inverse));
                __m512i q = _mm512_cvtps_epi32(v); /* round to nearest, ties to even */
                sum = _mm512_add_epi32(sum, q);
                _mm512_mask_cvtepi32_storeu_epi8(qm + start + j, mask, q);
            }
            float x_sum = len > 0 ? _mm512_reduce_add_ps(total) : 0.0f;
            /* a NaN input makes its row's outputs NaN, as a float product would (an infinite one already
             * does: its group's scale is infinite, times a zero sum) */
            xs[m * groups + g] = isnan(x_sum) ? NAN : amax / 127.0f;
            sums[m * groups + g] = _mm512_reduce_add_epi32(sum);
            x_sums[m * groups + g] = x_sum;
        }
    }
}

static inline __m512i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc + the products of u8's unsigned bytes and s8's signed ones, four into each int32 lane: what
 * _mm512_dpbusd_epi32(acc, u8, s8) computes, in inline assembly.  GCC 12 compiles the intrinsic in
 * the tiles' loops with a register copy after every dpbusd and the accumulators moved back at the
 * top of the loop (vpdpbusd writes its accumulator in place; the intrinsic's result is a new value),
 * 30 instructions for a tile's 8 dpbusd; the assembly's "+v" keeps each accumulator in its register.
 * On a 2-core Zen 5, the int8 products of 2048 / 512 / 64 rows (640 inputs, 4096 outputs) ran at
 * 340 / 334 / 411 G multiply-adds a second, 422 / 477 / 538 with it (the same tiles, outputs bit for
 * bit the same); the LM head's 8 rows from memory are bound by reading it either way. */
static inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}

/* Outputs of this many bytes and more are written past the caches (streaming stores): a block's 16
 * channels of a row are one whole cache line, so the line need not be read first, and an output far
 * larger than L2 leaves the caches to the weight and the quantized rows.  On a Xeon with AMX (2
 * threads, L2 2 MB a core), a 2048-row prefill chunk's products alone: gate_up (4096 outputs, its rows
 * 16 KB apart: a pass's rows all in the same cache sets) 12.2 -> 5.5 ms, down 4.1 -> 3.3 ms; in the
 * engine, quantized.py's 64-request int8 workload (fresh processes alternating, three runs each): the
 * steps that carry prompts 6.29-6.31 s with every output cached, 5.35-5.44 s streaming from 16 MB (the
 * gate_up product only), 4.83-5.15 s from 4 MB (every product of a 2048-row chunk: qkv 4.6 -> 2.3 ms
 * a call), 350-363 -> 413-419 tok/s; from 1 MB the same as from 4 within the noise; decode steps
 * (outputs of 64 rows: 1 MB and less) unchanged.  On the VNNI tiles (AMX kept out, the same CPU, two
 * runs each): prompt steps 6.93-7.47 -> 6.49-6.64 s, 312-315 -> 323-325 tok/s. */
#define STREAM_MIN_BYTES (4 << 20)

/* Whether y [rows, n_out] is written by streaming stores: large, and every block's line aligned. */
static inline int streams_output(const float *y, int64_t rows, int64_t n_out) {
    return y && rows * n_out * (int64_t)sizeof(float) >= STREAM_MIN_BYTES && n_out % LANES == 0 &&
           ((uintptr_t)y & 63) == 0;
}

/* out[j * mr + i]: row m0 + i of block b0 + j, times the channels' scales (NULL: none), into y
 * (``stream``: by streaming stores, streams_output's case). */
static inline void store_tile(const __m512 *out, int mr, int nb, int64_t m0, int64_t b0, const float *scale,
                              float *y, int64_t n_out, int stream) {
    for (int j = 0; j < nb; j++) {
        int64_t n0 = (b0 + j) * LANES, width = n_out - n0 < LANES ? n_out - n0 : LANES;
        __mmask16 mask = width == LANES ? 0xFFFF : (__mmask16)((1u << width) - 1);
        __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.0f);
        if (stream)
            for (int i = 0; i < mr; i++) _mm512_stream_ps(y + (m0 + i) * n_out + n0, _mm512_mul_ps(out[j * mr + i], s));
        else
            for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + (m0 + i) * n_out + n0, mask, _mm512_mul_ps(out[j * mr + i], s));
    }
}

/* Every (rows, blocks) tile the driver asks a kernel for: each kernel defines and dispatches them
 * with FOR_EACH_TILE(its macro).  One block a pass at every row count: with the weight streamed from
 * memory (a decode step's case) 1-4 rows over several blocks a pass (4 blocks for 1-2 rows, 2 for
 * 3-4: more accumulator chains) ran slower on a Zen 4 -- the int8 LM head at 1-4 rows 5.3-6.0 ->
 * 4.7-4.8 ms (two builds in one process, interleaved), the layers' int4 products at 1, 2 and 4 rows
 * 12-15% faster. */
#define FOR_EACH_TILE(X) X(1, 1) X(2, 1) X(3, 1) X(4, 1) X(5, 1) X(6, 1) X(7, 1) X(8, 1)
/* The int8 kernel's passes over two blocks, for products of VNNI_WIDE_MIN_ROWS rows and more (a
 * prefill chunk, a large batch's LM head): a weight quad loaded once serves 8 rows, a row's broadcast
 * quad 2 blocks (16 dpbusd for 10 loads rather than 8 for 9).  On a 2-core Zen 5, interleaved, 2048 /
 * 512 / 64 rows of 640 inputs by 4096 outputs 11.9 / 3.17 / 0.37 -> 11.0 / 2.76 / 0.27 ms and the
 * 262144-token head at 64 rows 25.8 -> 19.9 ms; at 16 rows the head was slower (5.0 -> 5.5 ms), and
 * 8 rows streaming a weight from memory keep one block a pass (above). */
#define FOR_EACH_WIDE_TILE(X) X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(6, 2) X(7, 2) X(8, 2)
#define VNNI_WIDE_MIN_ROWS 64

#define MAX_TILE_OUT 64 /* a pass's rows x blocks, at most (8 x 2 here, 32 x 2 on AMX tiles) */
#define MAX_PASS_ROWS 32 /* a pass's rows, at most (every kernel's rows_per_pass) */

/* A kernel's tile: mr rows by nb blocks from block b, into out[j * mr + i]. */
typedef void (*tile_fn)(int mr, int nb, const quantized_rows *rows, int64_t b, const void *weight, __m512 *out);

/* How a product's passes go: a pass is up to rows_per_pass rows by blocks_per_pass blocks, one call
 * of tile; begin_pass (or NULL) runs on a thread before each pass's tiles, finish (or NULL) on each
 * thread after its last (the AMX tiles' configuration and release). */
typedef struct {
    tile_fn tile;
    int rows_per_pass, blocks_per_pass;
    void (*begin_pass)(int mr, int64_t group);
    void (*finish)(void);
} vnni_kernel;

/* The AVX512-VNNI kernels' passes: ROWS rows by one block (by two: the wide tiles). */
#define VNNI_KERNEL(tile) ((vnni_kernel){(tile), ROWS, 1, NULL, NULL})
#define VNNI_WIDE_KERNEL(tile) ((vnni_kernel){(tile), ROWS, 2, NULL, NULL})

/* Each row's largest value of a tile (out[j * mr + i] times the channels' scales, as store_tile
 * computes it) kept lane by lane: best[i] holds row i's largest value in each lane over the blocks so
 * far and index[i] its channel, a later block's replacing it only when strictly larger, so each lane
 * keeps its first maximal channel (a value that is not finite sets *bad: the caller then takes the
 * logits).  The lanes are reduced once a chunk (best_of_lanes) rather than once a block: the int8 LM
 * head's greedy tokens (262144 x 640) on a Xeon with AMX, two builds interleaved, at 8 / 16 / 32 / 64
 * rows 5.51 / 7.01 / 9.84 / 18.09 -> 5.22 / 5.99 / 8.18 / 14.03 ms, 1-4 rows unchanged. */
static inline void best_of_tile(const __m512 *out, int mr, int nb, int64_t b0, const float *scale, int64_t n_out,
                                __m512 *best, __m512i *index, int *bad) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < nb; j++) {
        int64_t n0 = (b0 + j) * LANES, width = n_out - n0 < LANES ? n_out - n0 : LANES;
        __mmask16 mask = width == LANES ? 0xFFFF : (__mmask16)((1u << width) - 1);
        __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.0f);
        const __m512i channel = _mm512_add_epi32(_mm512_set1_epi32((int32_t)n0), lane);
        for (int i = 0; i < mr; i++) {
            __m512 v = _mm512_mul_ps(out[j * mr + i], s);
            /* |v| not below infinity: an infinity or a NaN */
            if (_mm512_mask_cmp_ps_mask(mask, _mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ)) *bad = 1;
            const __mmask16 above = _mm512_mask_cmp_ps_mask(mask, v, best[i], _CMP_GT_OQ);
            best[i] = _mm512_mask_mov_ps(best[i], above, v);
            index[i] = _mm512_mask_mov_epi32(index[i], above, channel);
        }
    }
}

/* Row i's largest value over its lanes and the first channel that holds it, into *top / *at (the
 * lowest channel among the lanes that hold it: each lane's is its first). */
static inline void best_of_lanes(__m512 best, __m512i index, float *top, int64_t *at) {
    const float t = _mm512_reduce_max_ps(best);
    const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(t), _CMP_EQ_OQ);
    *top = t;
    *at = holds ? _mm512_mask_reduce_min_epi32(holds, index) : -1;
}

/* y [rows, n_out] = the kernel's product of x [rows, k_in] (quantized here in groups of ``group``
 * inputs, k_pad = k_in rounded up to 4) with ``weight`` by its passes (``kernel``), times ``scale``
 * (NULL: none); or, with ``argmax`` (y unused), each row's first maximal output index into argmax[row] -- the
 * index torch.argmax of y would give -- without y's n_out values a row.  Returns 0; 1 (argmax only)
 * where some output was not finite (argmax then unset); -1 where its scratch could not be allocated. */
static int vnni_product(const float *x, int64_t rows, int64_t k_in, int64_t group, int64_t n_out,
                        const vnni_kernel *kernel, const void *weight, const float *scale, float *y, int64_t *argmax) {
    int64_t k_pad = (k_in + 3) & ~(int64_t)3, groups = (k_pad + group - 1) / group;
    int64_t blocks = (n_out + LANES - 1) / LANES, chunks = (blocks + CHUNK - 1) / CHUNK;
    int8_t *xq = malloc((size_t)(rows * k_pad) + 64);
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(rows * groups) + 64);
    float *x_sums = malloc(sizeof(float) * (size_t)(rows * groups) + 64);
    /* argmax: each chunk's best value and index a row, reduced in chunk order below */
    float *best = argmax ? malloc(sizeof(float) * (size_t)(chunks * rows)) : NULL;
    int64_t *index = argmax ? malloc(sizeof(int64_t) * (size_t)(chunks * rows)) : NULL;
    if (!xq || !xs || !sums || !x_sums || (argmax && (!best || !index))) {
        free(xq), free(xs), free(sums), free(x_sums), free(best), free(index);
        return -1;
    }
    quantize_rows(x, rows, k_in, k_pad, group, xq, xs, sums, x_sums);
    int bad = 0;
    const int stream = streams_output(y, rows, n_out);
    const int64_t rows_per_pass = kernel->rows_per_pass, blocks_per_pass = kernel->blocks_per_pass;
    const int64_t row_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel reduction(| : bad)
    {
        __m512 out[MAX_TILE_OUT];
#pragma omp for schedule(static) collapse(2)
        for (int64_t rb = 0; rb < row_blocks; rb++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t b_end = (c + 1) * CHUNK < blocks ? (c + 1) * CHUNK : blocks;
            int64_t m_end = (rb + 1) * ROW_BLOCK < rows ? (rb + 1) * ROW_BLOCK : rows;
            for (int64_t m0 = rb * ROW_BLOCK; m0 < m_end; m0 += rows_per_pass) {
                int mr = (int)(m_end - m0 < rows_per_pass ? m_end - m0 : rows_per_pass);
                quantized_rows part = {xq + m0 * k_pad, xs + m0 * groups, sums + m0 * groups, x_sums + m0 * groups,
                                       k_pad, groups, group, m0 == rb * ROW_BLOCK};
                __m512 lane_best[MAX_PASS_ROWS];
                __m512i lane_index[MAX_PASS_ROWS];
                for (int i = 0; argmax && i < mr; i++)
                    lane_best[i] = _mm512_set1_ps(-INFINITY), lane_index[i] = _mm512_set1_epi32(-1);
                if (kernel->begin_pass) kernel->begin_pass(mr, group);
                for (int64_t b = c * CHUNK; b < b_end; b += blocks_per_pass) {
                    int nb = (int)(b_end - b < blocks_per_pass ? b_end - b : blocks_per_pass);
                    kernel->tile(mr, nb, &part, b, weight, out);
                    if (argmax)
                        best_of_tile(out, mr, nb, b, scale, n_out, lane_best, lane_index, &bad);
                    else
                        store_tile(out, mr, nb, m0, b, scale, y, n_out, stream);
                }
                if (argmax)
                    for (int i = 0; i < mr; i++)
                        best_of_lanes(lane_best[i], lane_index[i], best + c * rows + m0 + i, index + c * rows + m0 + i);
            }
        }
        if (kernel->finish) kernel->finish();
        if (stream) _mm_sfence(); /* the streamed lines visible before the product returns */
    }
    if (argmax && !bad) best_of_chunks(best, index, rows, chunks, argmax);
    free(xq), free(xs), free(sums), free(x_sums), free(best), free(index);
    return argmax && bad ? 1 : 0;
}
#endif
