/* Few rows (decode) over fp8 e4m3 weights on AMX-BF16 tiles: y[M, N] = x[M, K] @ W.T with W
   as minisgl/quant/qtensor.py holds it (float8_e4m3fn codes, an fp32 scale per row and group:
   a 128x128 block's scale repeated over its rows, or one per row / per tensor, group = K).

   The decode GEMV (qgemv.c) converts each code in registers and multiplies it with one FMA per
   input row, so 8 rows cost ~2.7x one row. AMX-INT8 (qamxi.c) has no fp8 form, but every e4m3
   value is a bf16 exactly (4 exponent bits and 3 mantissa bits fit bf16's 8 and 7; the
   subnormals m * 2^-9 are normal bf16s): each code is converted once, a tile step at a time,
   into an L1 buffer, and one TDPBF16PS multiplies 16 weight rows x 32 features by up to 16
   input rows, so a weight byte costs the same work for 1 or 16 rows:

     y[m, n] = sum_g scale[n, g] * (sum_{k in g} bf16(code[n, k]) * x[m, k])

   x must be bf16 (the model's activations; fp32 x, which bf16 would round, runs qgemv:
   cpu_panel.py). The products are exact in fp32 and each group's sum is an fp32 tile of its
   own, scaled once in fp32 where the group ends: the dequantized weight's matmul to fp32
   rounding (qtensor.dequantize rounds code * scale to fp32 first; this rounds the sum).

   The conversion (qf_bf16x64): 64 codes per 64-byte load, each bf16's high and low byte
   looked up by the code's 7 magnitude bits in two 128-byte tables (VPERMT2B, AVX512-VBMI,
   which every AMX CPU has: subnormals and zero need no test), the sign bit or-ed in, and the
   two bytes interleaved into words (within 128-bit lanes: a tile row holds features 0-7,
   16-23, 32-39, 48-55 of the 64, the next one the others, and x is laid out per call in that
   order, qf_feature). 5 vector ops per 64 codes; the shifts-and-add alternative (8-9 ops and a
   test for subnormals) took 1.4x its time (Xeon, Sapphire Rapids class, KVM; one thread).

   Operands (C^T = W . x^T, as qamxi.c): A = 16 weight rows x 32 bf16 from the buffer, B = x^T
   [16 pairs][M input rows][2], C = 16 weight rows x M input rows, fp32. A thread's item is 32
   weight rows: 2 C tiles (its row halves, a block's two tile steps summed into each: one load
   per row at the fold; a C tile per step, added at the fold, took 1.03-1.08x the time), 2 A
   and 2 B tiles. Blocks of 64 features (of one group) are
   converted QF_LAG blocks ahead of their tile loads and C tiles are folded QF_LAG blocks after
   their stores (a tile load of lines still in the store buffer waits, as qamxi.c measured).
   The next item is prefetched into L2 across the current one's steps; items shared as amx.c
   shares them. More than 16 input rows run 16 at a time (each slab converts the weight again: the
   chooser keeps the panel kernels for many rows).

   Measured (Xeon, Sapphire Rapids class under KVM, amx_bf16 avx512vbmi; one thread, cold
   weights, CPU time, interleaved with qgemv, benchmarks/qgemv_bench.py): 8 rows 0.50-0.55x
   qgemv's 8-row time at 3072x1024, 1024x3072 and 12288x4096, 1.16-1.25x its 1-row time; 1
   row 1.03-1.16x qgemv's (the conversion, ~4 cycles per 64 codes on port 5, bounds it, not
   the bytes). A Qwen3-0.6B fp8 decode step (decode_step.py, one thread, CPU time): B=8
   1.27-1.28x B=1, was 1.96-2.09x.

   Compiled where the build targets AMX-TILE, AMX-BF16 and AVX512-BW/VL (cpu_build.py; the
   conversion alone for AVX512-VBMI); the entry points exist only there and run only after
   the CPU said it has VBMI and amx_ready() (amx.h) granted the tiles. */
#include "common.h"
#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)

#include <string.h>

#define QF_ROWS 32    /* weight rows per item: two A tiles */
#define QF_STEP 32    /* features per tile step: an A row of 32 bf16 */
#define QF_BLOCK 64   /* features converted by one 64-byte load: two tile steps */
#define QF_LAG 2      /* blocks between conversion and tile loads, tile stores and folds */
#define QF_SLOT (2 * QF_ROWS * QF_STEP) /* bf16 per converted block */
#define QF_VBMI __attribute__((target("avx512vbmi")))

/* One call's shape and x, prepared once for every thread. */
typedef struct {
    int64_t M, N, K, gs;
    int64_t cstride, gstride; /* bytes between rows of codes, floats between rows of scales */
    const uint8_t* codes;
    const float* scales;
    uint16_t* xb; /* [blocks][2 steps][16 pairs][M][2]: the B tiles of each block */
    int64_t blocks;
    int64_t* block; /* [blocks + 1]: block i is features [block[i], block[i + 1]) of one group,
                       64 of them (or 32: a group's or K's last) */
    uint8_t table[2][128] __attribute__((aligned(64))); /* bf16 high, low byte of |code| */
} QfCall;

/* The bf16 bytes of every e4m3 magnitude (7 bits: exponent e, mantissa m; e = 0: m 2^-9). */
static void qf_tables(QfCall* c) {
    for (int v = 0; v < 128; v++) {
        int e = v >> 3, m = v & 7;
        float f = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
        uint32_t b;
        memcpy(&b, &f, 4);
        c->table[0][v] = (uint8_t)(b >> 24), c->table[1][v] = (uint8_t)(b >> 16);
    }
}

/* Feature (of its 64-feature block) in element i of tile step h's A rows: the byte lookups
   interleave within 128-bit lanes (qf_bf16x64). */
static inline int64_t qf_feature(int64_t h, int64_t i) { return (i / 8) * 16 + h * 8 + i % 8; }

/* A block of `len` (64 or 32) codes of a row -> its bf16 values, tile step 0's elements at
   dst, step 1's at dst + 32 rows' worth: bytes looked up in the tables (VPERMT2B, every
   code), the sign copied in, high and low bytes interleaved into words. Absent codes (len
   32) are zero. */
static inline QF_VBMI __attribute__((always_inline)) void qf_bf16x64(
    const uint8_t* src, int64_t len, const __m512i* tab, uint16_t* dst) {
    __m512i v = _mm512_maskz_loadu_epi8(len == 64 ? ~0ull : 0xFFFFFFFFull, src);
    __m512i hi = _mm512_permutex2var_epi8(tab[0], v, tab[1]);
    __m512i lo = _mm512_permutex2var_epi8(tab[2], v, tab[3]);
    hi = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | v & 80 */
    _mm512_store_si512((__m512i*)dst, _mm512_unpacklo_epi8(lo, hi));
    _mm512_store_si512((__m512i*)(dst + QF_ROWS * QF_STEP), _mm512_unpackhi_epi8(lo, hi));
}

/* Rows r0..r1 of block i (`a` the item's first row's codes) -> slot [2 steps][32 rows][32]. */
static QF_VBMI void qf_convert(const QfCall* c, const uint8_t* a, int64_t r0, int64_t r1,
                               int64_t i, uint16_t* slot) {
    const __m512i tab[4] = {_mm512_load_si512(c->table[0]), _mm512_load_si512(c->table[0] + 64),
                            _mm512_load_si512(c->table[1]), _mm512_load_si512(c->table[1] + 64)};
    const int64_t k = c->block[i], len = c->block[i + 1] - k;
    for (int64_t r = r0; r < r1; r++)
        qf_bf16x64(a + r * c->cstride + k, len, tab, slot + r * QF_STEP);
}

/* x rows -> the B tiles of block i: step h, pair p holds (for each input row m) the features
   A's elements 2p and 2p + 1 hold; zeros past the block's end. */
static void qf_pack_x(QfCall* c, const uint16_t* x, int64_t i) {
    const int64_t M = c->M, K = c->K, k = c->block[i], len = c->block[i + 1] - k;
    for (int64_t h = 0; h < 2; h++)
        for (int64_t p = 0; p < 16; p++) {
            uint16_t* out = c->xb + ((i * 2 + h) * 16 + p) * M * 2;
            for (int64_t j = 0; j < 2; j++) {
                int64_t f = qf_feature(h, 2 * p + j);
                for (int64_t m = 0; m < M; m++) out[2 * m + j] = f < len ? x[m * K + k + f] : 0;
            }
        }
}

/* Issues `lines` cache lines of the next item (rows of `row_lines` lines, `stride` bytes
   apart) evenly over `steps` calls of qf_prefetch. */
typedef struct {
    const char* base;
    int64_t stride, row_lines, lines, steps, credit, row, col;
} QfAhead;

static inline void qf_prefetch(QfAhead* p) {
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps) {
        _mm_prefetch(p->base + p->row * p->stride + 64 * p->col, _MM_HINT_T1);
        if (++p->col == p->row_lines) p->col = 0, p->row++;
    }
}

/* A group's sums (C tiles 0 and 1 in `cb`: rows 0-15, rows 16-31) times each row's scale,
   added into acc[16 r + m]. */
static inline void qf_fold(const QfCall* c, const float* cb, int64_t n0, int64_t rows,
                           int64_t g, float* acc) {
    for (int64_t r = 0; r < rows; r++) {
        const float* h = cb + (r / 16) * 256 + (r % 16) * 16;
        __m512 t = _mm512_load_ps(h);
        __m512 s = _mm512_set1_ps(c->scales[(n0 + r) * c->gstride + g]);
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(t, s, _mm512_load_ps(acc + 16 * r)));
    }
}

/* One item: weight rows n0.. (`rows` of them) into y. `ring`: QF_LAG + 1 converted blocks;
   `cbuf`: QF_LAG + 1 groups' C tiles (1024 floats apart). Block i + QF_LAG is converted in
   four parts between block i's tile loads and products: the tile unit then works while the
   vector ports convert (a whole block converted before the tiles' turn: 1.04-1.12x the
   time). */
static void qf_item(const QfCall* c, int64_t n0, uint16_t* ring, QfAhead* pf, float* cbuf,
                    float* acc, void* y, int out_bf16) {
    const int64_t rows = c->N - n0 < QF_ROWS ? c->N - n0 : QF_ROWS, blocks = c->blocks;
    const uint8_t* a = c->codes + n0 * c->cstride;
    const int64_t bstride = 4 * c->M; /* bytes per B tile row */
    if (rows < QF_ROWS) /* a last, short item: the rows past N multiply zeros */
        for (int64_t s = 0; s < (QF_LAG + 1) * 2; s++)
            memset(ring + s * QF_ROWS * QF_STEP + rows * QF_STEP, 0,
                   sizeof(uint16_t) * (QF_ROWS - rows) * QF_STEP);
    for (int r = 0; r < QF_ROWS; r++) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t i = 0; i < QF_LAG && i < blocks; i++)
        qf_convert(c, a, 0, rows, i, ring + i * QF_SLOT);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < blocks + QF_LAG; i++) {
        if (i < blocks) {
            const int64_t ahead = i + QF_LAG < blocks ? i + QF_LAG : -1;
            uint16_t* next = ring + ((i + QF_LAG) % (QF_LAG + 1)) * QF_SLOT;
#define QF_PART(p) \
    if (ahead >= 0) qf_convert(c, a, rows * (p) / 4, rows * ((p) + 1) / 4, ahead, next)
            const uint16_t* s = ring + (i % (QF_LAG + 1)) * QF_SLOT;
            const uint16_t* xb = c->xb + i * 2 * 16 * 2 * c->M;
            QF_PART(0);
            _tile_loadd(4, s, 2 * QF_STEP);
            _tile_loadd(5, s + 16 * QF_STEP, 2 * QF_STEP);
            _tile_loadd(6, xb, bstride);
            QF_PART(1);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            s += QF_ROWS * QF_STEP;
            QF_PART(2);
            _tile_loadd(4, s, 2 * QF_STEP);
            _tile_loadd(5, s + 16 * QF_STEP, 2 * QF_STEP);
            _tile_loadd(7, xb + 16 * 2 * c->M, bstride);
            QF_PART(3);
            _tile_dpbf16ps(0, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
#undef QF_PART
            qf_prefetch(pf);
            if (c->block[i + 1] % c->gs == 0) { /* the group ends: its sums out, tiles zeroed */
                float* cb = cbuf + (i % (QF_LAG + 1)) * 1024;
                _tile_stored(0, cb, 64);
                _tile_stored(1, cb + 256, 64);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
        }
        int64_t j = i - QF_LAG;
        if (j >= 0 && c->block[j + 1] % c->gs == 0)
            qf_fold(c, cbuf + (j % (QF_LAG + 1)) * 1024, n0, rows, c->block[j] / c->gs, acc);
    }
    for (int64_t m = 0; m < c->M; m++)
        for (int64_t r = 0; r < rows; r++) store(y, m * c->N + n0 + r, acc[16 * r + m], out_bf16);
}

/* The tiles for this call: C 16 weight rows x M input rows fp32, A 16 rows x 32 bf16, B 16
   pairs x M input rows. C tiles 2 and 3 are configured and zeroed with 0 and 1 but hold no
   sums: measured 0.93-0.97x the time of leaving them out (cause not found). */
static void qf_config(int64_t M) {
    AmxConfig cfg;
    amx_config_init(&cfg);
    for (int t = 0; t < 4; t++) amx_config_tile(&cfg, t, 16, (int)(4 * M));
    amx_config_tile(&cfg, 4, 16, 2 * QF_STEP);
    amx_config_tile(&cfg, 5, 16, 2 * QF_STEP);
    amx_config_tile(&cfg, 6, 16, (int)(4 * M));
    amx_config_tile(&cfg, 7, 16, (int)(4 * M));
    amx_config(&cfg);
}

/* At most 16 input rows. */
static void qf_slab(const uint16_t* x, const uint8_t* codes, int64_t cstride,
                    const float* scales, int64_t gstride, void* y, int out_bf16, int64_t M,
                    int64_t N, int64_t K, int64_t gs) {
    QfCall c = {M, N, K, gs, cstride, gstride, codes, scales, NULL, 0, NULL, {{0}}};
    qf_tables(&c);
    c.block = (int64_t*)malloc(sizeof(int64_t) * (K / QF_STEP + 2));
    c.block[0] = 0;
    for (int64_t k = 0; k < K;) { /* at most QF_BLOCK features, never across a group */
        int64_t gend = (k / gs + 1) * gs;
        k = gend < k + QF_BLOCK ? gend : k + QF_BLOCK;
        c.block[++c.blocks] = k;
    }
    const int64_t blocks = c.blocks, items = (N + QF_ROWS - 1) / QF_ROWS;
    const int64_t row_lines = (K + 63) / 64;
    c.xb = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * blocks * 2 * 32 * M + 64);
    Share shares[SHARE_MAX];
    int parts = share_parts();
    shares_init(shares, parts, items);
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks; i++) qf_pack_x(&c, x, i);
        qf_config(M);
        uint16_t* ring = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * (QF_LAG + 1) * QF_SLOT);
        float* cbuf = (float*)aligned_alloc(64, sizeof(float) * (QF_LAG + 1) * 1024);
        /* lanes past M are never stored: zeros, not garbage that could be subnormal (every
           multiply-add on a subnormal takes a microcode assist) */
        memset(cbuf, 0, sizeof(float) * (QF_LAG + 1) * 1024);
        float* acc = (float*)aligned_alloc(64, sizeof(float) * QF_ROWS * 16);
        int64_t expect = -1;
        for (int64_t q; (q = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            int64_t n0 = q * QF_ROWS;
            if (q != expect) /* not the item prefetched: fetch it now */
                for (int64_t r = n0; r < n0 + QF_ROWS && r < N; r++)
                    for (int64_t l = 0; l < row_lines; l++)
                        _mm_prefetch((const char*)codes + r * cstride + 64 * l, _MM_HINT_T1);
            int64_t nq = q + 1;
            int next_full = nq < items && N - nq * QF_ROWS >= QF_ROWS;
            QfAhead pf = {next_full ? (const char*)(codes + nq * QF_ROWS * cstride) : NULL,
                          cstride, row_lines, QF_ROWS * row_lines, blocks, 0, 0, 0};
            qf_item(&c, n0, ring, &pf, cbuf, acc, y, out_bf16);
            expect = q + 1;
        }
        amx_release();
        free(acc);
        free(cbuf);
        free(ring);
    }
    free(c.xb);
    free(c.block);
}

/* 1 where this kernel may run (the tiles granted to this process), else 0. */
int qamxf_ready(void) { return __builtin_cpu_supports("avx512vbmi") && amx_ready(); }

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (bf16 only: x_bf16 must be 1) @ W.T; the
   arguments are qgemv.c's (zeros unused: fp8 has none; gs % 32 == 0, K % gs == 0). */
void qamxf_fp8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
               const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
               int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)x_bf16, (void)zeros;
    const size_t ysize = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t m0 = 0; m0 < M; m0 += 16)
        qf_slab((const uint16_t*)x + m0 * K, codes, cstride, scales, gstride,
                (char*)y + m0 * N * ysize, out_bf16, M - m0 < 16 ? M - m0 : 16, N, K, gs);
}

#else
typedef int qamxf_not_built; /* no AMX-BF16 in this build: no entry points (cpu_kernels.py) */
#endif
