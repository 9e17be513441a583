/* How the panel kernels (panel_gemm_cpu.c, bf16_panel_cpu.c) split a product's panels of 16 output
 * columns among their threads: groups of `per_group` consecutive panels, the last one possibly
 * partial (fewer panels, or a last panel with fewer than 16 real columns). */
#ifndef PANEL_GROUPS_H
#define PANEL_GROUPS_H
#include <stdint.h>

typedef struct {
    int64_t first; /* the group's first panel */
    int count;     /* panels in it */
    int last_cols; /* real columns of its last panel */
} panel_group;

/* Group g of the panels of an n-column product, `lanes` columns a panel. */
static inline panel_group panel_group_at(int64_t g, int per_group, int64_t n, int lanes) {
    const int64_t num_panels = (n + lanes - 1) / lanes, first = g * per_group;
    const int count = (int)(num_panels - first < per_group ? num_panels - first : per_group);
    const int64_t after_last = n - (first + count - 1) * lanes; /* columns from the last panel on */
    return (panel_group){first, count, (int)(after_last < lanes ? after_last : lanes)};
}
#endif
