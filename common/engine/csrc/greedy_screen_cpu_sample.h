/* The screen's sampling phase (included by greedy_screen_cpu.c after its ISA's code). */

/* A sampled token from its panels' m_j and s_j (pass 1): rejection sampling, exact for the fp32
 * logits l.  Propose panel j with probability U_j / sum U (U_j = s_j exp(m_j - M), M = max m_j),
 * compute its logits in fp32 and its mass S_j = sum exp(l_c / T - M), accept with probability
 * S_j / U'_j (U'_j = U_j (1 + 2^-10) >= S_j), then take row c with probability exp(l_c / T - M) / S_j:
 * a trial returns row c with probability exp(l_c / T - M) / sum U', so an accepted token is a
 * sample of softmax(l / T).  Three uniform numbers a trial (u[3 trial ..]); SAMPLE_TRIALS trials.
 * A proposal is a binary search of the U_j's running sums (the first panel whose sum exceeds
 * u sum U).  Returns the rows computed in fp32, -2 where the caller must sample from the logits
 * instead (a bound or logit not finite, an envelope that failed, or no trial accepted);
 * `scratch` [2 num_panels]: the U_j, then their running sums. */
static int64_t sample_token(const screen_args *s, const float *x, const float *panels, int64_t token,
                            const double *u, double *scratch, int64_t *trials, int64_t *out) {
    const int64_t np = s->num_panels, k = s->k;
    const float *m = s->upper + token * np, *mass = s->mass + token * np;
    double top = -INFINITY, total = 0.0;
    for (int64_t j = 0; j < np; j++) {
        if (m[j] == INFINITY) return -2;
        if (mass[j] > 0.0f && m[j] > top) top = m[j];
    }
    if (!isfinite(top)) return -2;
    double *running = scratch + np;
    int64_t last = -1; /* the last panel with mass: a target the sums do not exceed (rounding) takes it */
    for (int64_t j = 0; j < np; j++) {
        total += scratch[j] = mass[j] > 0.0f ? mass[j] * exp((double)m[j] - top) : 0.0;
        running[j] = total;
        if (scratch[j] > 0.0) last = j;
    }
    const double inv_t = s->inv_t[token];
    int64_t computed = 0;
    for (int trial = 0; trial < SAMPLE_TRIALS; trial++) {
        const double *ut = u + 3 * trial;
        const double target = ut[0] * total;
        int64_t lo = 0, hi = last; /* the first j with running[j] > target: its U_j is > 0 */
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (running[mid] > target) hi = mid;
            else lo = mid + 1;
        }
        const int64_t j = lo;
        const int real = panel_rows(s, j);
        float l[LANES];
        double e[LANES], mass_j = 0.0;
        exact_panel(x, panels + j * k * LANES, k, l);
        computed += real;
        for (int c = 0; c < real; c++) {
            if (!isfinite(l[c])) return -2;
            mass_j += e[c] = exp((double)l[c] * inv_t - top);
        }
        const double envelope = scratch[j] * (1.0 + 0x1p-10);
        if (!(mass_j <= envelope)) return -2;
        if (ut[1] * envelope >= mass_j) continue; /* rejected */
        const double pick = ut[2] * mass_j;
        int row = -1;
        double run = 0.0;
        for (int c = 0; c < real; c++) {
            if (e[c] <= 0.0) continue;
            row = c;
            run += e[c];
            if (run > pick) break;
        }
        if (row < 0) continue; /* the whole panel underflowed: cannot be drawn */
        out[token] = j * LANES + row;
        if (trials) trials[token] = trial + 1;
        return computed;
    }
    return -2;
}
