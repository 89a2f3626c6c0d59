/* The "panel" matmul of the AVX-512 build: y[M, N] = x[M, K] @ W[N, K].T from bf16 weights
   repacked once into 32-column panels whose K is laid out in pairs, the layout VDPBF16PS
   reads: panel q holds W's rows 32q..32q+31 as [K/2][32][2] bf16, so one 64-byte load gives
   16 columns' weights for two k, and one VDPBF16PS against x's pair (broadcast as one 32-bit
   value) does their 32 products (exact, bf16 x bf16) with fp32 sums, the arithmetic of
   gemv512 and oneDNN's bf16 path. On CPUs without AVX512-BF16 (Ice Lake, Cascade Lake) bf16 x
   is widened to fp32 once per call and runs the fp32 tiles below: the same exact products,
   16-lane FMAs (measured on such a Xeon, 2 threads, cold 6144x1024 / 1024x3072 weights: 1.07-
   1.16x the rate of panel.c's 8-lane tiles, which ran there before, at 1-4 rows, 1.5-1.8x at
   8-12, 1.6-1.9x at 16-320). (The AVX2 build compiles panel.c: 16-column panels.)

   One layout serves every row count:
   - up to TR1 rows stream each panel once over all of K in one register
     tile (up to 12 rows x 32 columns: 24 accumulators of the 32 registers), the lines ahead of
     the read prefetched by hand (a thread reads one contiguous run of panels): below PF_MANY
     rows 2 KB ahead into L1, from PF_MANY rows on, where the tile's dot products take about
     as long as the memory, 8 KB ahead into L2, which keeps the memory busy while the tile
     computes. Measured on a 2-core AMD EPYC Zen 4 (the 0.6B decode step's 113 matmuls, cold
     weights, old and new A/B interleaved layer by layer, machine shared): one thread (CPU
     time) 8 KB into L2 against 2 KB into L1 0.86-0.89x the time at 8 rows, 0.74-0.99x at 6-7,
     0.93-0.95x at 10-12, but 1.07-1.12x at 3-5 rows and 1.04-1.4x at 1-2, where the loop
     waits on the memory anyway (4 KB: 1.06-1.2x at 6-8; 16 KB: 0.96x at 8; 2 KB into L1 as
     well: no better); two threads (the sum of each call's best wall time over 15 steps, as
     the other work left no undisturbed step) 0.75-0.88x at 8 rows, 0.93x at 7, 0.82x at 12,
     but 1.09-1.16x at 6 (two threads share the memory: a row count is more memory-bound),
     hence PF_MANY 7. (Until then the L2 switch compiled to prefetcht0 either way: gcc merged
     the two branches. Each tile is now compiled once per prefetch mode, so its loop tests
     nothing but its count.) In a one-tile pass the hardware prefetcher alone does about as
     well as 2 KB into L1 at 1 row;
   - more rows walk K in chunks of KC (128 KB of a panel, held in L2) and pass tiles of up to
     TR rows, of near-equal sizes, over each chunk (the accumulators wait in a buffer between
     chunks), the next chunk prefetched into L2 during the first two tiles (a line a pair
     each, panel512_spread; in the first tile alone, two lines a pair, the prefetches queued
     behind the memory and held the tile's products up: on a Xeon without AVX512-BF16, 2
     threads, cold weights, spread over two tiles 1.06-1.27x faster at 13-32 rows, 1.0-1.05x
     at 64-320), so the weights come from memory once for up to MB rows. Measured on a
     2-core AMD EPYC Zen 4, one thread, cold bf16 weights 4096x1024 / 1024x3072: chunks of
     2048 k with an L2 prefetch one chunk ahead 1.1-1.3x the rate of 256 k with an L1 prefetch
     two ahead at 9-32 rows (a 16 KB chunk and the two prefetched behind it overflow L1); one
     12-row tile 1.1-1.2x two tiles of 5 + 4 or 6 + 6 at 9-12 rows; past 12 rows, tiles of 8
     ahead of tiles of 12.
   fp32 x (an x of another dtype than the model's, or bf16 x widened where the CPU lacks
   AVX512-BF16) runs on the same panels with FMAs: a shift and a mask split each 32-bit pair
   into its two fp32 weights (products in fp32, as panel.c), the tiles and passes as bf16 x's.
   K % 16 == 0 (as supports_panel asks). */
#include "common.h"

#ifdef __AVX512F__

#define PW 32 /* columns per panel */
#define KC 2048 /* k per chunk: 1024 pairs, 128 KB of a panel (in L2) */
#define TR 8 /* rows per register tile of a chunked pass (16 accumulators) */
#define TR1 12 /* the most rows one tile streams over all of K (24 accumulators) */
#define MB 160 /* input rows per pass over the weights (their accumulators on the stack) */

/* The panels' layout, for the Python side (cpu_kernels.panel_rows): 1 = K pairs, 32 columns. */
int panel_layout = 1;
/* How far ahead of the read a one-tile pass prefetches (bytes of the thread's run of panels)
   and into which cache (0: L1, 1: L2), for fewer than PF_MANY rows and for more: switches for
   the benchmarks. */
#define PF_MANY 7
int64_t panel512_pf_ahead = 2048;
int panel512_pf_l2 = 0;
int64_t panel512_pf_many_ahead = 8192;
int panel512_pf_many_l2 = 1;
/* 1: fewer rows prefetch as PF_MANY rows do. Set at start-up by the faster on the running
   machine (cpu_kernels.measure_panel_few_rows_far): 2 KB into L1 was 1.04-1.4x faster at 1-2
   rows on a 2-core Zen 4, 8 KB into L2 1.06-1.13x faster at 1-4 rows on a Xeon without
   AVX512-BF16 (2 threads, cold weights). */
int panel_few_rows_far = 0;
/* 1: a chunked pass's prefetch of the next chunk spread over its first two tiles (see the top);
   0: all in the first tile. A switch for the benchmarks. */
int panel512_spread = 1;

/* 16 columns x 16 pairs at a time through a dword transpose in registers (the 151936x1024
   LM head into touched memory, one thread of the Zen 4 below: 46 ms, against 99 ms for one
   pair at a time, the same bytes); the pairs left over (K / 2 % 16) and missing rows one at
   a time. */
void panel_pack_bf16(const uint16_t* w, uint16_t* p, int64_t N, int64_t K) {
    int64_t panels = (N + PW - 1) / PW, pairs = K / 2, full = pairs / 16 * 16;
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++) {
        uint32_t* out = (uint32_t*)(p + q * K * PW);
        for (int h = 0; h < PW / 16; h++) {
            int64_t n0 = q * PW + 16 * h;
            for (int64_t j0 = 0; j0 < full; j0 += 16) {
                __m512i r[16];
                for (int c = 0; c < 16; c++)
                    r[c] = n0 + c < N ? _mm512_loadu_si512(w + (n0 + c) * K + 2 * j0)
                                      : _mm512_setzero_si512();
                transpose16(r);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_si512(out + (j0 + j) * PW + 16 * h, r[j]);
            }
            for (int c = 0; c < 16; c++)
                for (int64_t j = full; j < pairs; j++) {
                    uint32_t v = 0;
                    if (n0 + c < N) __builtin_memcpy(&v, w + (n0 + c) * K + 2 * j, 4);
                    out[j * PW + 16 * h + c] = v;
                }
        }
    }
}

/* Pair j's prefetch in `mode` 1 (its two lines into L1), 2 (into L2) or 3 (line j into L2:
   half the rate, for a chunk's next one spread over two tiles). */
static inline __attribute__((always_inline)) void prefetch_pair(const char* pf, int64_t j,
                                                              int mode) {
    if (mode == 3) {
        _mm_prefetch(pf + j * 64, _MM_HINT_T1);
    } else if (mode == 2) {
        _mm_prefetch(pf + j * 128, _MM_HINT_T1);
        _mm_prefetch(pf + j * 128 + 64, _MM_HINT_T1);
    } else {
        _mm_prefetch(pf + j * 128, _MM_HINT_T0);
        _mm_prefetch(pf + j * 128 + 64, _MM_HINT_T0);
    }
}

/* Each tile below is compiled four times, without a prefetch and with each of prefetch_pair's
   (`mode` 0-3: a constant in each copy; `l2` 0: into L1, 1: into L2, 2: into L2 a line a
   pair), so that its loop tests nothing but its count (and no branch the compiler may merge:
   see the top). */
#define PF_MODES(NAME, XT)                                                                   \
    static inline void NAME(const XT* x, int64_t ldx, int64_t np, const uint16_t* pw,        \
                            float* acc, const char* pf, int l2) {                            \
        if (!pf) NAME##_k(x, ldx, np, pw, acc, pf, 0);                                       \
        else if (l2 == 2) NAME##_k(x, ldx, np, pw, acc, pf, 3);                              \
        else if (l2) NAME##_k(x, ldx, np, pw, acc, pf, 2);                                   \
        else NAME##_k(x, ldx, np, pw, acc, pf, 1);                                           \
    }

#ifdef __AVX512BF16__
static inline __m512bh pair_of(const uint16_t* x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* R rows of bf16 x (row i at x + i * ldx, from the chunk's first k) against `np` pairs of a
   panel chunk pw: acc[i * 32 + c] += sum over the pairs. `pf`: prefetch pf + 128 j at pair j
   (mode 0: none). */
#define BF_TILE(NAME, R)                                                                     \
    static inline __attribute__((always_inline)) void NAME##_k(                              \
        const uint16_t* x, int64_t ldx, int64_t np, const uint16_t* pw, float* acc,          \
        const char* pf, const int mode) {                                                    \
        __m512 a0[R], a1[R];                                                                 \
        for (int i = 0; i < R; i++) {                                                        \
            a0[i] = _mm512_loadu_ps(acc + 32 * i);                                           \
            a1[i] = _mm512_loadu_ps(acc + 32 * i + 16);                                      \
        }                                                                                    \
        _Pragma("GCC unroll 2") for (int64_t j = 0; j < np; j++) {                          \
            if (mode) prefetch_pair(pf, j, mode);                                            \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw + j * 64);                         \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(pw + j * 64 + 32);                    \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                          \
                __m512bh xv = pair_of(x + i * ldx + 2 * j);                                  \
                a0[i] = _mm512_dpbf16_ps(a0[i], xv, w0);                                     \
                a1[i] = _mm512_dpbf16_ps(a1[i], xv, w1);                                     \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < R; i++) {                                                        \
            _mm512_storeu_ps(acc + 32 * i, a0[i]);                                           \
            _mm512_storeu_ps(acc + 32 * i + 16, a1[i]);                                      \
        }                                                                                    \
    }                                                                                        \
    PF_MODES(NAME, uint16_t)
BF_TILE(bf_tile12, 12)
BF_TILE(bf_tile11, 11)
BF_TILE(bf_tile10, 10)
BF_TILE(bf_tile9, 9)
BF_TILE(bf_tile8, 8)
BF_TILE(bf_tile7, 7)
BF_TILE(bf_tile6, 6)
BF_TILE(bf_tile5, 5)
BF_TILE(bf_tile4, 4)
BF_TILE(bf_tile3, 3)

/* One or two rows: pairs in twos on separate accumulators (one chain each would wait on the
   dot product's latency when the panel is in cache). np even (K % 16 == 0). */
#define BF_TILE_SPLIT(NAME, R)                                                               \
    static inline __attribute__((always_inline)) void NAME##_k(                              \
        const uint16_t* x, int64_t ldx, int64_t np, const uint16_t* pw, float* acc,          \
        const char* pf, const int mode) {                                                    \
        __m512 a[2][R][2];                                                                   \
        for (int i = 0; i < R; i++)                                                          \
            for (int h = 0; h < 2; h++) {                                                    \
                a[0][i][h] = _mm512_loadu_ps(acc + 32 * i + 16 * h);                         \
                a[1][i][h] = _mm512_setzero_ps();                                            \
            }                                                                                \
        for (int64_t j = 0; j < np; j += 2) {                                                \
            if (mode) {                                                                      \
                prefetch_pair(pf, j, mode);                                                  \
                prefetch_pair(pf, j + 1, mode);                                              \
            }                                                                                \
            for (int s = 0; s < 2; s++) {                                                    \
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw + (j + s) * 64);               \
                __m512bh w1 = (__m512bh)_mm512_loadu_si512(pw + (j + s) * 64 + 32);          \
                for (int i = 0; i < R; i++) {                                                \
                    __m512bh xv = pair_of(x + i * ldx + 2 * (j + s));                        \
                    a[s][i][0] = _mm512_dpbf16_ps(a[s][i][0], xv, w0);                       \
                    a[s][i][1] = _mm512_dpbf16_ps(a[s][i][1], xv, w1);                       \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < R; i++)                                                          \
            for (int h = 0; h < 2; h++)                                                      \
                _mm512_storeu_ps(acc + 32 * i + 16 * h,                                      \
                                 _mm512_add_ps(a[0][i][h], a[1][i][h]));                     \
    }                                                                                        \
    PF_MODES(NAME, uint16_t)
BF_TILE_SPLIT(bf_tile2, 2)
BF_TILE_SPLIT(bf_tile1, 1)

static inline void bf_tile(int r, const uint16_t* x, int64_t ldx, int64_t np, const uint16_t* pw,
                           float* acc, const char* pf, int l2) {
    switch (r) {
        case 12: bf_tile12(x, ldx, np, pw, acc, pf, l2); break;
        case 11: bf_tile11(x, ldx, np, pw, acc, pf, l2); break;
        case 10: bf_tile10(x, ldx, np, pw, acc, pf, l2); break;
        case 9: bf_tile9(x, ldx, np, pw, acc, pf, l2); break;
        case 8: bf_tile8(x, ldx, np, pw, acc, pf, l2); break;
        case 7: bf_tile7(x, ldx, np, pw, acc, pf, l2); break;
        case 6: bf_tile6(x, ldx, np, pw, acc, pf, l2); break;
        case 5: bf_tile5(x, ldx, np, pw, acc, pf, l2); break;
        case 4: bf_tile4(x, ldx, np, pw, acc, pf, l2); break;
        case 3: bf_tile3(x, ldx, np, pw, acc, pf, l2); break;
        case 2: bf_tile2(x, ldx, np, pw, acc, pf, l2); break;
        default: bf_tile1(x, ldx, np, pw, acc, pf, l2);
    }
}

#endif

/* Pair j of a panel chunk as fp32: w[0], w[1] the even k's columns 0-15 and 16-31, w[2], w[3]
   the odd k's (a shift and a mask of each 32-bit pair). */
static inline __attribute__((always_inline)) void pair_f32(const uint16_t* pw, int64_t j,
                                                         __m512* w) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i v0 = _mm512_loadu_si512(pw + j * 64), v1 = _mm512_loadu_si512(pw + j * 64 + 32);
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
    w[1] = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
    w[2] = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
    w[3] = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
}

/* fp32 x, 1-3 rows: each pair's even and odd k on accumulators of their own (few rows would
   wait on the FMA latency). */
#define F32_TILE(NAME, R)                                                                    \
    static inline __attribute__((always_inline)) void NAME##_k(                              \
        const float* x, int64_t ldx, int64_t np, const uint16_t* pw, float* acc,             \
        const char* pf, const int mode) {                                                    \
        __m512 e0[R], e1[R], o0[R], o1[R];                                                   \
        for (int i = 0; i < R; i++) {                                                        \
            e0[i] = _mm512_loadu_ps(acc + 32 * i);                                           \
            e1[i] = _mm512_loadu_ps(acc + 32 * i + 16);                                      \
            o0[i] = o1[i] = _mm512_setzero_ps();                                             \
        }                                                                                    \
        _Pragma("GCC unroll 2") for (int64_t j = 0; j < np; j++) {                          \
            if (mode) prefetch_pair(pf, j, mode);                                            \
            __m512 w[4]; /* even k: columns 0-15, 16-31; odd k: the same */                  \
            pair_f32(pw, j, w);                                                              \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                           \
                __m512 xe = _mm512_set1_ps(x[i * ldx + 2 * j]);                              \
                __m512 xo = _mm512_set1_ps(x[i * ldx + 2 * j + 1]);                          \
                e0[i] = _mm512_fmadd_ps(xe, w[0], e0[i]);                                    \
                e1[i] = _mm512_fmadd_ps(xe, w[1], e1[i]);                                    \
                o0[i] = _mm512_fmadd_ps(xo, w[2], o0[i]);                                    \
                o1[i] = _mm512_fmadd_ps(xo, w[3], o1[i]);                                    \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < R; i++) {                                                        \
            _mm512_storeu_ps(acc + 32 * i, _mm512_add_ps(e0[i], o0[i]));                     \
            _mm512_storeu_ps(acc + 32 * i + 16, _mm512_add_ps(e1[i], o1[i]));                \
        }                                                                                    \
    }                                                                                        \
    PF_MODES(NAME, float)
F32_TILE(f32_tile3, 3)
F32_TILE(f32_tile2, 2)
F32_TILE(f32_tile1, 1)

/* fp32 x, 4 rows and more: a pair's even and odd k on the same accumulator (two FMAs a pair in
   a row: R >= 4 rows keep 8 R products in flight, the FMA latency's worth), so up to 12 rows
   fit a register tile as bf16 x's do. */
#define F32_WIDE_TILE(NAME, R)                                                               \
    static inline __attribute__((always_inline)) void NAME##_k(                              \
        const float* x, int64_t ldx, int64_t np, const uint16_t* pw, float* acc,             \
        const char* pf, const int mode) {                                                    \
        __m512 a0[R], a1[R];                                                                 \
        for (int i = 0; i < R; i++) {                                                        \
            a0[i] = _mm512_loadu_ps(acc + 32 * i);                                           \
            a1[i] = _mm512_loadu_ps(acc + 32 * i + 16);                                      \
        }                                                                                    \
        _Pragma("GCC unroll 2") for (int64_t j = 0; j < np; j++) {                          \
            if (mode) prefetch_pair(pf, j, mode);                                            \
            __m512 w[4]; /* even k: columns 0-15, 16-31; odd k: the same */                  \
            pair_f32(pw, j, w);                                                              \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                          \
                __m512 xe = _mm512_set1_ps(x[i * ldx + 2 * j]);                              \
                __m512 xo = _mm512_set1_ps(x[i * ldx + 2 * j + 1]);                          \
                a0[i] = _mm512_fmadd_ps(xo, w[2], _mm512_fmadd_ps(xe, w[0], a0[i]));         \
                a1[i] = _mm512_fmadd_ps(xo, w[3], _mm512_fmadd_ps(xe, w[1], a1[i]));         \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < R; i++) {                                                        \
            _mm512_storeu_ps(acc + 32 * i, a0[i]);                                           \
            _mm512_storeu_ps(acc + 32 * i + 16, a1[i]);                                      \
        }                                                                                    \
    }                                                                                        \
    PF_MODES(NAME, float)
F32_WIDE_TILE(f32_tile12, 12)
F32_WIDE_TILE(f32_tile11, 11)
F32_WIDE_TILE(f32_tile10, 10)
F32_WIDE_TILE(f32_tile9, 9)
F32_WIDE_TILE(f32_tile8, 8)
F32_WIDE_TILE(f32_tile7, 7)
F32_WIDE_TILE(f32_tile6, 6)
F32_WIDE_TILE(f32_tile5, 5)
F32_WIDE_TILE(f32_tile4, 4)

static inline void f32_tile(int r, const float* x, int64_t ldx, int64_t np, const uint16_t* pw,
                            float* acc, const char* pf, int l2) {
    switch (r) {
        case 12: f32_tile12(x, ldx, np, pw, acc, pf, l2); break;
        case 11: f32_tile11(x, ldx, np, pw, acc, pf, l2); break;
        case 10: f32_tile10(x, ldx, np, pw, acc, pf, l2); break;
        case 9: f32_tile9(x, ldx, np, pw, acc, pf, l2); break;
        case 8: f32_tile8(x, ldx, np, pw, acc, pf, l2); break;
        case 7: f32_tile7(x, ldx, np, pw, acc, pf, l2); break;
        case 6: f32_tile6(x, ldx, np, pw, acc, pf, l2); break;
        case 5: f32_tile5(x, ldx, np, pw, acc, pf, l2); break;
        case 4: f32_tile4(x, ldx, np, pw, acc, pf, l2); break;
        case 3: f32_tile3(x, ldx, np, pw, acc, pf, l2); break;
        case 2: f32_tile2(x, ldx, np, pw, acc, pf, l2); break;
        default: f32_tile1(x, ldx, np, pw, acc, pf, l2);
    }
}

/* r rows of x from element `at` (row stride ldx) against np pairs of a panel chunk. */
static inline void tile(int r, const void* x, int x_bf16, int64_t at, int64_t ldx, int64_t np,
                        const uint16_t* pw, float* acc, const char* pf, int l2) {
#ifdef __AVX512BF16__
    if (x_bf16) {
        bf_tile(r, (const uint16_t*)x + at, ldx, np, pw, acc, pf, l2);
        return;
    }
#else
    (void)x_bf16; /* panel_bf16 widened it to fp32 */
#endif
    f32_tile(r, (const float*)x + at, ldx, np, pw, acc, pf, l2);
}

/* x rows [0, mb) (row stride K; bf16 where x_bf16) against panel pq (all of K), into acc
   [mb][32]. Row tiles of near-equal size (17 rows: 6 + 6 + 5, not 8 + 8 + 1: a one-row tile
   re-reads the chunk for a fraction of the dot products). `pf_end`: the first byte past the
   packed weights (no prefetch beyond). */
static void panel_rows(const void* x, int x_bf16, int64_t K, int64_t mb, const uint16_t* pq,
                       float* acc, const char* pf_end) {
    int64_t tiles = mb <= TR1 ? 1 : (mb + TR - 1) / TR;
    if (tiles == 1) { /* one tile over all of K, streaming */
        int many = mb >= PF_MANY || panel_few_rows_far;
        int l2 = many ? panel512_pf_many_l2 : panel512_pf_l2;
        const char* pf = (const char*)pq + (many ? panel512_pf_many_ahead : panel512_pf_ahead);
        if (pf + K * 64 > pf_end) pf = 0;
        tile((int)mb, x, x_bf16, 0, K, K / 2, pq, acc, pf, l2);
        return;
    }
    int64_t base = mb / tiles, extra = mb % tiles;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        const uint16_t* pw = pq + k0 * PW;
        const char* pf = (const char*)(pw + KC * PW);
        if (pf + kc * 64 > pf_end) pf = 0;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; t++) {
            int r = (int)(base + (t < extra));
            const char* at = panel512_spread && pf && t < 2 ? pf + t * kc * 32 : t == 0 ? pf : 0;
            tile(r, x, x_bf16, m * K + k0, K, kc / 2, pw, acc + m * PW, at,
                 panel512_spread ? 2 : 1);
            m += r;
        }
    }
}

/* 32 fp32 outputs (lo: the first 16) as bf16, to the nearest, ties to even. */
static inline __m512i bf16_of(__m512 lo, __m512 hi) {
#ifdef __AVX512BF16__
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(pack16_bf16(lo)), pack16_bf16(hi), 1);
#endif
}

/* y = x @ W.T from the packed panels `p` (panel_pack_bf16); x fp32, or bf16 where x_bf16. */
void panel_bf16(const void* x, const uint16_t* p, void* y, int64_t M, int64_t N, int64_t K,
                int out_bf16, int x_bf16) {
    int64_t panels = (N + PW - 1) / PW;
    const char* end = (const char*)(p + panels * K * PW);
    size_t xsize = x_bf16 ? 2 : 4;
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    /* Passes of near-equal size (161 rows: 81 + 80, not 160 + 1: every pass reads all the
       weights). */
    int64_t passes = (M + MB - 1) / MB;
#ifndef __AVX512BF16__
    /* No bf16 dot products on this CPU: a pass's bf16 rows are widened to fp32 once, for the
       FMA tiles (a pass's products take ~100x the widening's time). */
    float* wide = x_bf16 ? (float*)aligned_alloc(64, sizeof(float) * (M < MB ? M : MB) * K) : 0;
#endif
    for (int64_t m0 = 0, pass = 0, mb; m0 < M; m0 += mb, pass++) {
        mb = M / passes + (pass < M % passes);
        const char* xm = (const char*)x + m0 * K * xsize;
        int xb = x_bf16;
#ifndef __AVX512BF16__
        if (wide) {
            widen_bf16(xm, mb * K, wide);
            xm = (const char*)wide;
            xb = 0;
        }
#endif
        shares_init(shares, parts, panels);
        #pragma omp parallel
        for (int64_t q; (q = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            float acc[MB * PW] __attribute__((aligned(64)));
            for (int64_t i = 0; i < mb * PW; i++) acc[i] = 0.f;
            panel_rows(xm, xb, K, mb, p + q * K * PW, acc, end);
            int64_t n0 = q * PW;
            int cols = N - n0 < PW ? (int)(N - n0) : PW;
            for (int64_t i = 0; i < mb; i++) {
                const float* a = acc + i * PW;
                if (cols == PW && out_bf16) {
                    uint16_t* out = (uint16_t*)y + (m0 + i) * N + n0;
                    _mm512_storeu_si512(out, bf16_of(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)));
                } else if (cols == PW) {
                    float* out = (float*)y + (m0 + i) * N + n0;
                    _mm512_storeu_ps(out, _mm512_loadu_ps(a));
                    _mm512_storeu_ps(out + 16, _mm512_loadu_ps(a + 16));
                } else {
                    for (int c = 0; c < cols; c++) store(y, (m0 + i) * N + n0 + c, a[c], out_bf16);
                }
            }
        }
    }
#ifndef __AVX512BF16__
    free(wide);
#endif
}

#endif
