/* What the AMX tile kernels share (greedy_screen_cpu.c's pass 1, int8_amx.h's int8 products):
 * Linux's permission for the tile state and the tile configuration's layout.  Included only where
 * the compiler targets AMX on Linux. */
#ifndef AMX_H
#define AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX state only to a process that asks (once; oneDNN may have asked already). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* LDTILECFG's 64-byte operand (palette 1): each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0 .. count - 1 as rows[i] rows of colsb[i] bytes, on the calling thread. */
static inline void amx_load_config(int count, const uint8_t *rows, const uint16_t *colsb) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < count; i++) {
        c.rows[i] = rows[i];
        c.colsb[i] = colsb[i];
    }
    /* GCC 12 does not count LDTILECFG as reading its operand and drops the stores above (seen here:
     * a config of zeros, then #GP); the barrier keeps them. */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif
