/*
 * Grammar masks applied to logits in place: for each listed row r, logits[rows[r], t] = -inf
 * where bit t % 32 of word t / 32 of bitmask[r] is clear (t < vocab).  A word with every bit set
 * (all 32 tokens allowed) costs one compare; a clear word sets its 32 logits at once.  One row
 * is one thread's work (OpenMP over rows).
 *
 * logits: fp32 [*, vocab] with row stride ``stride`` (elements); bitmask: int32 [n, words] with
 * words >= ceil(vocab / 32); rows: int64 [n].
 * Built by common/engine/cpu_kernels.py with the system C compiler; loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t stride, int64_t vocab, const uint32_t *bitmask, int64_t words,
                         const int64_t *rows, int64_t n) {
    const float neg_inf = -INFINITY;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float *row = logits + rows[r] * stride;
        const uint32_t *mask = bitmask + r * words;
        int64_t full_words = vocab / 32;
        for (int64_t w = 0; w < full_words; w++) {
            uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            float *out = row + w * 32;
            if (bits == 0) {
                for (int b = 0; b < 32; b++) out[b] = neg_inf;
                continue;
            }
            for (int b = 0; b < 32; b++)
                if (!((bits >> b) & 1u)) out[b] = neg_inf;
        }
        for (int64_t t = full_words * 32; t < vocab; t++)
            if (!((mask[t / 32] >> (t % 32)) & 1u)) row[t] = neg_inf;
    }
}
