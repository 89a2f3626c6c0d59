/* y[M, N] = x[M, K] @ W[N, K].T on AMX tiles, straight from the weight as loaded (row-major
   bf16): no second copy of the weights, and one kernel for every row count from 1 to prefill.

   AMX multiplies C[16 x 16] += A[16 x 32] . B[32 x 16] with B in the "VNNI" layout (k in
   pairs: B's row kp holds, for each of its 16 columns, elements 2kp and 2kp + 1). A row-major
   weight is exactly an A operand (16 weight rows x 32 consecutive k, loaded with the rows'
   stride), so the kernel computes C^T = W . x^T: A = 16 weight rows, B = x^T (x packed per call
   into the pair layout, cheap: activations are small), C = 16 outputs x 16 input rows, written
   back transposed. A thread's item is a block of 32 weight rows (two A tiles, contiguous in
   memory): it is read from memory once and used against every 16-row tile of x (from the
   caches after the first), two x tiles at a time (4 C + 2 A + 2 B = the 8 tiles).

   The weights stream from memory: a block's tile loads read 32 rows at once, which the
   hardware prefetcher cannot follow, so the next block is prefetched by hand, in memory order,
   spread over the current block's k steps (over all its passes when x has more than 32 rows).

   x rows are padded with zeros to a multiple of 16 (the padding costs tile arithmetic, not
   memory time), a last block of fewer than 32 weight rows is copied into a zero-padded buffer
   (so no tile reads past the weight). K must be a multiple of 32 (cpu_kernels.supports_amx). */
#include "amx.h"
#include "common.h"

#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define ROWS 32 /* weight rows per item: two A tiles */

/* Where the next block is prefetched to (0: L1, 1: L2, 2: no prefetch): set from Python for
   measurements (cpu_kernels.load().amx_prefetch_hint). The default is L2: one block (32 rows
   x K) is larger than L1 at the K of a model's matmuls, and L2 measured ahead of L1 and of no
   prefetch at 8-64 rows (1.1-1.2x, one core of a Xeon with AMX, weights cold). */
int amx_prefetch_hint = 1;

/* Weight rows of a page (4 KB) or longer: whether they are left to the hardware prefetcher
   (1), which follows a stream within a page, with each k step's lines sent to L1 one step
   ahead, instead of the next block prefetched in memory order (0). Measured on a Xeon with
   AMX (2 threads, cold weights cycled over 1 GB): at 8 rows 1024x2048 23.3 -> 24.5 GB/s,
   1024x3072 22.7 -> 25.6, 4096x12288 19.4 -> 28.2; at 32 rows 20.7 -> 22.4, 20.2 -> 23.2,
   16.1 -> 26.0; rows of 2 KB (K = 1024) lost that way (6144x1024, 8 rows: 25.7 -> 22.6), so
   they keep the block prefetch, as do blocks that take more than one pass (over 32 rows of
   x: the next block's prefetch then overlaps the passes' products; without it the 512-row
   passes that measure the matmul peak ran 1.2x slower). Set per process by
   cpu_kernels.measure_amx_rows_to_hardware, which measures it on the running machine. */
int amx_rows_to_hardware = 0;
#define AMX_PAGE 4096

static inline void prefetch_line(const char* p) {
    if (amx_prefetch_hint == 0)
        _mm_prefetch(p, _MM_HINT_T0);
    else if (amx_prefetch_hint == 1)
        _mm_prefetch(p, _MM_HINT_T1);
}

/* Issues `lines` cache lines of `base` evenly over `steps` calls of pf_step. */
typedef struct {
    const char* base;
    int64_t lines, steps, issued, credit;
} Ahead;

static inline void pf_step(Ahead* p) {
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps)
        prefetch_line(p->base + 64 * p->issued++);
}

/* The lines of the block's next k step (32 rows of 64 bytes, stride K) into L1, where its
   rows are left to the hardware (`near`): the tile loads then find them there. */
static inline void next_step_lines(const uint16_t* a, int64_t K, int64_t kb, int64_t kblocks,
                                   int near) {
    if (!near || kb + 1 >= kblocks) return;
    const char* p = (const char*)(a + (kb + 1) * 32);
    for (int r = 0; r < ROWS; r++) _mm_prefetch(p + r * K * 2, _MM_HINT_T0);
}


/* x rows [16 mt, 16 mt + 16) x k pairs [16 kb, 16 kb + 16) into the pair layout: 16 rows of
   kp, each the 16 x rows' (2 kp, 2 kp + 1) as one 32-bit lane; rows past M are zeros. */
static void pack_x_block(const uint32_t* x, int64_t M, int64_t half, int64_t mt, int64_t kb,
                         uint32_t* dst) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) {
        int64_t m = mt * 16 + i;
        r[i] = m < M ? _mm512_loadu_ps(x + m * half + kb * 16) : _mm512_setzero_ps();
    }
    transpose16((__m512i*)r); /* __m512i is may_alias (immintrin) */
    for (int j = 0; j < 16; j++) _mm512_store_ps(dst + j * 16, r[j]);
}

/* A C tile (16 weight rows x 16 x rows, fp32) to y, transposed: y[m0 + i][n0 + j] for
   i < mrows, j < ncols. */
static void store_c(const float* c, void* y, int64_t N, int64_t m0, int mrows, int64_t n0,
                    int ncols, int out_bf16) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + i * 16);
    transpose16((__m512i*)r); /* __m512i is may_alias (immintrin) */
    __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    for (int i = 0; i < mrows; i++) {
        int64_t at = (m0 + i) * N + n0;
        if (out_bf16) { /* round to nearest even, as common.h's store() */
            __m256i h = pack16_bf16(r[i]);
            _mm256_mask_storeu_epi16((uint16_t*)y + at, mask, h);
        } else {
            _mm512_mask_storeu_ps((float*)y + at, mask, r[i]);
        }
    }
}

/* Tiles 0-3 += A (weight rows a, a + 16 rows) . B (x tiles b0, b1) over all of K:
   C0 = a.b0, C1 = a.b1, C2 = a'.b0, C3 = a'.b1. */
static inline void dot2x2(const uint16_t* a, int64_t K, const uint32_t* b0, const uint32_t* b1,
                          int64_t kblocks, Ahead* pf, int near) {
    const uint16_t* a2 = a + 16 * K;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        next_step_lines(a, K, kb, kblocks, near);
        _tile_loadd(4, a + kb * 32, K * 2);
        _tile_loadd(6, b0 + kb * 256, 64);
        _tile_loadd(5, a2 + kb * 32, K * 2);
        _tile_loadd(7, b1 + kb * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        pf_step(pf);
    }
}

/* The same with one x tile: C0 = a.b0, C2 = a'.b0. */
static inline void dot2x1(const uint16_t* a, int64_t K, const uint32_t* b0, int64_t kblocks,
                          Ahead* pf, int near) {
    const uint16_t* a2 = a + 16 * K;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        next_step_lines(a, K, kb, kblocks, near);
        _tile_loadd(4, a + kb * 32, K * 2);
        _tile_loadd(6, b0 + kb * 256, 64);
        _tile_loadd(5, a2 + kb * 32, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        pf_step(pf);
    }
}

/* The C tiles (0-3): zeroed before a pass over K (amx.h amx_zero_tiles_0_3), stored to cbuf
   (4 x 256 floats) after. */
static inline void c_tiles_store(float* cbuf) {
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

/* Tiles 0 to n - 1 (n = 3 or 4) += A (16 weight rows a) . B (x tiles b, b + tile, ...) over all
   of K: each x tile's B operand loaded into tile 5, 6 or 7 in turn, so a load never waits for
   the product still reading the tile before it. */
static inline void dot1xn(const uint16_t* a, int64_t K, const uint32_t* b, int64_t tile, int n,
                          int64_t kblocks, Ahead* pf) {
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * 32, K * 2);
        _tile_loadd(5, b + kb * 256, 64);
        _tile_loadd(6, b + tile + kb * 256, 64);
        _tile_loadd(7, b + 2 * tile + kb * 256, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        if (n == 4) {
            _tile_loadd(5, b + 3 * tile + kb * 256, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        pf_step(pf);
    }
}

/* 3 x tiles (33 to 48 rows of x), or 4 with weight rows of a page or more: the block's two
   16-row halves in turn, each against every x tile in one pass over K, so the block is read
   from memory once instead of once per pass of two x tiles (block below), at the price of
   loading every x tile for each half. The same products in the same order: the same bits.
   Cold weights over 1 GB, 2 threads, on a Xeon with AMX, two passes -> halves: 33 rows
   1.03x (6144x1024), 1.08x (1024x3072), 1.17x (4096x4096), 1.23x (4096x12288); 64 rows 1.02x
   and 1.15x on the last two, but 0.96-1.01x with rows of 2 KB, where the x tiles' loads (4 KB
   a k step) cost about what the second pass over the block from L2 did. */
static void block_halves(const uint16_t* a, const uint32_t* xp, int64_t M, int64_t N,
                         int64_t K, int64_t n0, void* y, int out_bf16, const char* next,
                         float* cbuf) {
    int64_t kblocks = K / 32, mtiles = (M + 15) / 16, tile = (K / 2) * 16;
    Ahead pf = {next, next ? ROWS * K * 2 / 64 : 0, 2 * kblocks, 0, 0};
    for (int h = 0; h < 2; h++) {
        int ncols = N - n0 - 16 * h < 16 ? (int)(N - n0 - 16 * h) : 16;
        amx_zero_tiles_0_3();
        dot1xn(a + 16 * h * K, K, xp, tile, (int)mtiles, kblocks, &pf);
        c_tiles_store(cbuf);
        for (int t = 0; t < mtiles && ncols > 0; t++) {
            int mrows = M - 16 * t < 16 ? (int)(M - 16 * t) : 16;
            store_c(cbuf + 256 * t, y, N, 16 * t, mrows, n0 + 16 * h, ncols, out_bf16);
        }
    }
}

/* One item: weight rows [n0, n0 + 32) (`a`, stride K) against every x tile. */
static void block(const uint16_t* a, const uint32_t* xp, int64_t M, int64_t N, int64_t K,
                  int64_t n0, void* y, int out_bf16, const char* next, int near,
                  float* cbuf) {
    int64_t kblocks = K / 32, mtiles = (M + 15) / 16, tile = (K / 2) * 16;
    int ncols0 = N - n0 < 16 ? (int)(N - n0) : 16;
    int ncols1 = N - n0 - 16 < 16 ? (int)(N - n0 - 16) : 16;
    int64_t passes = (mtiles + 1) / 2;
    Ahead pf = {next, next ? ROWS * K * 2 / 64 : 0, passes * kblocks, 0, 0};
    for (int64_t mt = 0; mt < mtiles; mt += 2) {
        int two = mt + 1 < mtiles;
        amx_zero_tiles_0_3();
        if (two)
            dot2x2(a, K, xp + mt * tile, xp + (mt + 1) * tile, kblocks, &pf, near);
        else
            dot2x1(a, K, xp + mt * tile, kblocks, &pf, near);
        c_tiles_store(cbuf);
        for (int t = 0; t < 1 + two; t++) {
            int64_t m0 = (mt + t) * 16;
            int mrows = M - m0 < 16 ? (int)(M - m0) : 16;
            store_c(cbuf + 256 * t, y, N, m0, mrows, n0, ncols0, out_bf16);
            if (ncols1 > 0) store_c(cbuf + 512 + 256 * t, y, N, m0, mrows, n0 + 16, ncols1, out_bf16);
        }
    }
}

static void config_tiles(void) {
    AmxConfig c;
    amx_config_init(&c);
    for (int t = 0; t < 8; t++) amx_config_tile(&c, t, 16, 64);
    amx_config(&c);
}

int amx_available(void) { return amx_ready(); }

/* The rows of x one pass over the weights takes: every weight block is multiplied by all of
   them, so their packed copy is read once per block and must stay in the core's L2 (half of
   it: the block and the outputs need the rest). More rows are done a chunk at a time, each
   chunk a pass over the weights: at prefill sizes reading the weights a few times costs less
   than streaming a packed x larger than L2 once per 32 weight rows (measured at M=3840 on one
   core of a Xeon with AMX: 1.7x at 6144x1024, 3.2x at 1024x3072). */
static int64_t chunk_rows(int64_t K) {
    static long l2 = -1;
    if (l2 < 0) {
        long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = v > 0 ? v : 1L << 20; /* not reported (some VMs): assume 1 MB */
    }
    int64_t rows = (int64_t)(l2 / 2) / (K * 2) / 32 * 32;
    return rows < 64 ? 64 : rows;
}

static int amx_chunk(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N,
                     int64_t K, int out_bf16);

/* x [M, K] bf16, W [N, K] bf16 row-major, y [M, N] bf16 (out_bf16) or fp32; K % 32 == 0.
   Returns 0 when AMX cannot be used in this process (nothing computed). */
int amx_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
             int out_bf16) {
    if (!amx_ready() || K % 32 || M <= 0 || N <= 0) return 0;
    int64_t rows = chunk_rows(K), size = out_bf16 ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += rows)
        if (!amx_chunk(x + m0 * K, w, (char*)y + m0 * N * size, M - m0 < rows ? M - m0 : rows,
                       N, K, out_bf16))
            return 0;
    return 1;
}

/* One chunk of x's rows against every weight block. */
static int amx_chunk(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N,
                     int64_t K, int out_bf16) {
    int64_t mtiles = (M + 15) / 16, half = K / 2, kblocks = K / 32;
    int64_t items = (N + ROWS - 1) / ROWS;
    uint32_t* xp = (uint32_t*)aligned_alloc(64, (size_t)(mtiles * half * 16 * 4));
    if (!xp) return 0;
    Share shares[SHARE_MAX];
    int parts = share_parts();
    shares_init(shares, parts, items);
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < mtiles * kblocks; p++) {
            int64_t mt = p / kblocks, kb = p % kblocks;
            pack_x_block((const uint32_t*)x, M, half, mt, kb, xp + mt * half * 16 + kb * 256);
        }
        config_tiles();
        float cbuf[4 * 256] __attribute__((aligned(64)));
        uint16_t* pad = 0;
        int64_t expect = -1;
        const int near = amx_rows_to_hardware && K * 2 >= AMX_PAGE && mtiles <= 2;
        for (int64_t q; (q = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            int64_t n0 = q * ROWS;
            const uint16_t* a = w + n0 * K;
            if (N - n0 < ROWS) { /* a last, short block: zero-padded rows, read no further */
                if (!pad) pad = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * ROWS * K);
                __builtin_memset(pad, 0, sizeof(uint16_t) * ROWS * K);
                __builtin_memcpy(pad, a, sizeof(uint16_t) * (N - n0) * K);
                a = pad;
            } else if (q != expect && !near) { /* not the block prefetched: fetch it now */
                for (int64_t l = 0; l < ROWS * K * 2 / 64; l++)
                    prefetch_line((const char*)a + 64 * l);
            }
            const char* next = q + 2 <= items - 1 || (q + 1 < items && N % ROWS == 0)
                                   ? (const char*)(a + ROWS * K)
                                   : 0;
            if (amx_prefetch_hint == 2 || near) next = 0;
            if (mtiles == 3 || (mtiles == 4 && K * 2 >= AMX_PAGE))
                block_halves(a, xp, M, N, K, n0, y, out_bf16, next, cbuf);
            else
                block(a, xp, M, N, K, n0, y, out_bf16, next, near, cbuf);
            expect = q + 1;
        }
        amx_release();
        free(pad);
    }
    free(xp);
    return 1;
}

#else
int amx_available(void) { return 0; }
int amx_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
             int out_bf16) {
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)out_bf16;
    return 0;
}
#endif
