/* What both builds of the quantized-activation products share (vnni_rows.h for AVX512-VNNI,
 * vnni_rows_avx2.h for AVX2 with FMA): the blocks of output channels, how threads take them, and the
 * quantized rows a kernel's tile reads. */
#ifndef VNNI_SHARED_H
#define VNNI_SHARED_H
#include <math.h>
#include <stdint.h>

#define LANES 16 /* output channels a block */
#define CHUNK 4  /* blocks a thread takes at a time */
#define PARALLEL_MIN (1 << 16) /* inputs to quantize before rows are split among threads */

/* The quantized rows handed to a kernel's tile: rows m0.. of xq [rows, k_pad] (int8, the pad zero),
 * xs [rows, groups] (the groups' scales), sums [rows, groups] (each group's sum of xq) and x_sums
 * (each group's sum of x, fp32); and whether this pass is its row block's first over the chunk of
 * blocks (``first_pass``: the weight's bytes come from memory then, and from the caches in the
 * passes after it -- the AMX tiles prefetch only in the first; the AVX2 build sets it, unread). */
typedef struct {
    const int8_t *xq;
    const float *xs;
    const int32_t *sums;
    const float *x_sums;
    int64_t k_pad, groups, group;
    int first_pass;
} quantized_rows;

/* argmax[m]: the index of row m's largest value over its chunks' bests (best[c * rows + m] at
 * index[c * rows + m], chunks in channel order), the first chunk's where several hold it. */
static inline void best_of_chunks(const float *best, const int64_t *index, int64_t rows, int64_t chunks,
                                  int64_t *argmax) {
    for (int64_t m = 0; m < rows; m++) {
        float top = -INFINITY;
        argmax[m] = -1;
        for (int64_t c = 0; c < chunks; c++)
            if (best[c * rows + m] > top) top = best[c * rows + m], argmax[m] = index[c * rows + m];
    }
}
#endif
