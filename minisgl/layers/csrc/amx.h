/* AMX (Advanced Matrix Extensions) set-up shared by the AMX kernels (amx.c, the quantized
   ones): the kernel's permission to use the tile registers, and the tile configuration.

   Linux hands a process the 8 KB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
   without it the first tile instruction kills the process with SIGILL. amx_ready() asks once
   per process (the permission then holds for every thread, present and future) and says
   whether AMX may be used; a refusal (an old kernel, a hypervisor hiding the state) only means
   "no AMX", never a crash. The tile configuration is per thread and other libraries (oneDNN)
   load their own on the same threads: every parallel region loads its configuration on each
   thread before its first tile instruction and releases the tiles at its end (amx_config /
   amx_release), so nothing is assumed about what ran before.

   Compiled into every build; the tile code exists only where the compiler targets AMX
   (-mamx-tile, cpu_build.py), elsewhere amx_ready() is 0. */
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_GET_XCOMP_PERM 0x1022
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

/* 1 once the kernel granted this process the tile data state, 0 if it refused; asked once
   (a race between first callers only asks twice, which is harmless). */
static inline int amx_ready(void) {
    static int state = -1; /* -1: not asked yet */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    uint64_t granted = 0;
    s = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0 &&
        syscall(SYS_arch_prctl, AMX_ARCH_GET_XCOMP_PERM, &granted) == 0 &&
        (granted & (1ull << AMX_XFEATURE_XTILEDATA)) != 0;
    __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    return s;
}

/* The 64-byte operand of LDTILECFG (palette 1: 8 tiles of up to 16 rows x 64 bytes). */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of each tile */
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxConfig;

/* An empty configuration (every tile unused) on palette 1. */
static inline void amx_config_init(AmxConfig* c) {
    memset(c, 0, sizeof *c);
    c->palette_id = 1;
}

/* Tile `t` as `rows` rows of `colsb` bytes (rows <= 16, colsb <= 64). */
static inline void amx_config_tile(AmxConfig* c, int t, int rows, int colsb) {
    c->rows[t] = (uint8_t)rows;
    c->colsb[t] = (uint16_t)colsb;
}

/* Load the configuration on the calling thread (zeroes every tile). */
static inline void amx_config(const AmxConfig* c) { _tile_loadconfig(c); }

/* Give the tile state back at the end of a region: the thread then no longer carries 8 KB of
   tile state through context switches, and the next user's configuration starts clean. */
static inline void amx_release(void) { _tile_release(); }

/* Tiles 0-3 (a kernel's four C tiles) zeroed: tile numbers are immediates. */
static inline void amx_zero_tiles_0_3(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

#else
static inline int amx_ready(void) { return 0; }
#endif
