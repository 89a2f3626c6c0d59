/* AVX-512 GEMV, only in the AVX-512 build: y[M, N] = x[M, K] @ W[N, K].T for small M, from
   the weights in the row layout they are loaded in. 16 lanes, and with AVX512-BF16 one
   VDPBF16PS does 32 bf16 products per input row straight from the packed weights (x must then
   be bf16 too: exact products, fp32 sums, as oneDNN's bf16 path).

   Memory: a block is 8 weight rows, each a short stream (2 KB at K=1024); every thread walks
   its own contiguous run of blocks while the blocks PF_BLOCKS ahead are prefetched by hand,
   the prefetches spread over every pass the block takes (Prefetch in common.h), so memory
   never idles while a block is re-read for more input rows. Measured on an Intel Xeon with
   AVX512-BF16 and AMX, one thread, cold weights, B=1 at 4096x1024: the former 4-row blocks
   with prefetches in the first pass only 74% of the thread's read rate, 8-row blocks with
   the prefetch into L2 (T1) 97-100%, into L1 (T0) 90%: a core's misses in flight, not its
   arithmetic, bound one stream there, and a T1 prefetch holds no L1 fill buffer.

   Arithmetic: no lane is spent on rows that do not exist: 1 input row runs as an 8x1 tile,
   2 as 8x2, more in passes of 4 input rows over each 4-row half of the block (16
   accumulators of the 32 registers; a half stays in L1 while the passes re-read it, so the
   weights come from memory once). From about 8 rows on a core is bound by its dot products
   (VDPBF16PS), not by memory: the AMX kernel (amx.c) serves those. */
#include "common.h"

/* Where the prefetched lines go: 0 L2 (T1, the default, see above), 1 L1 (T0, as gemv.c):
   a switch for the benchmarks (qgemv_bench.py) to compare the two on other CPUs. */
int gemv512_prefetch_l1 = 0;

/* The Prefetch of common.h with the lines sent where gemv512_prefetch_l1 says. */
static inline void prefetch_step_l2(Prefetch* p) {
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps) {
        const char* line = p->base + 64 * p->issued++;
        if (gemv512_prefetch_l1)
            _mm_prefetch(line, _MM_HINT_T0);
        else
            _mm_prefetch(line, _MM_HINT_T1);
    }
}

/* Up to 8 input rows: the block's rows one after another, each read start to end, so a
   thread's weights are one sequential stream (rows lie back to back) rather than 8 streams
   2 KB apart; lines SEQ_NEAR bytes ahead go to L1 and SEQ_FAR bytes ahead to L2 as the stream
   moves. Measured on an Intel Xeon with AMX (2 threads, cold bf16 weights cycled over 1 GB):
   one row 1.02-1.12x the blocks' rate (151936x1024 28.9 -> 32.3 GB/s), 2 rows 1.06-1.21x, 4
   rows 1.15-1.22x, 8 rows 1.06-1.2x (there the dot products bound it, and amx.c is faster
   from 4 rows on); near 256-768 and far none or 2 KB within 1 GB/s of each other. Whether a
   CPU reads faster this way is measured at start-up (cpu_kernels.measure_gemv512_rows_in_turn)
   into this switch: 1 in turn, 0 the blocks. */
int gemv512_rows_in_turn = 0;
#define SEQ_NEAR 256
#define SEQ_FAR 2048

/* The lines of one 4-vector step of the stream at p, SEQ_NEAR and SEQ_FAR on (none at or past
   stop, the end of the weight). */
static inline void seq_prefetch(const char* p, const char* stop, int lines) {
    for (int l = 0; l < lines; l++) {
        const char* near = p + SEQ_NEAR + 64 * l;
        const char* far = p + SEQ_FAR + 64 * l;
        if (near < stop) _mm_prefetch(near, _MM_HINT_T0);
        if (far < stop) _mm_prefetch(far, _MM_HINT_T1);
    }
}

/* Rows [n0, n0 + rows) of w, in turn, x MR input rows: each row's sum in the k order the
   blocks' tiles take (the same bits); the next row's loads run while a row's dot products
   finish. K % STEP == 0. */
#define ROWS_IN_TURN(NAME, MR, WT, STEP, VT, LOAD, DOT)                                      \
    static void NAME(const WT* w, const WT* x, int64_t K, void* y, int64_t N, int64_t n0,    \
                     int rows, const char* stop, int out_bf16) {                            \
        const int lines = (int)(4 * STEP * sizeof(WT) / 64);                                 \
        for (int j = 0; j < rows; j++) {                                                     \
            const WT* r = w + (n0 + j) * K;                                                  \
            __m512 acc[MR];                                                                  \
            for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                       \
            for (int64_t k = 0; k < K; k += STEP) {                                          \
                if (k % (4 * STEP) == 0) seq_prefetch((const char*)(r + k), stop, lines);    \
                VT wv = LOAD(r + k);                                                         \
                for (int i = 0; i < MR; i++) acc[i] = DOT(acc[i], wv, LOAD(x + i * K + k));  \
            }                                                                                \
            for (int i = 0; i < MR; i++)                                                     \
                store(y, i * N + n0 + j, _mm512_reduce_add_ps(acc[i]), out_bf16);            \
        }                                                                                    \
    }

/* R weight rows (wr) x MR input rows from row m of x: y[m + i, n0 + j] for j < rows. LOAD
   gives a weight or input vector at a pointer, DOT accumulates their products. */
#define TILE(NAME, R, MR, WT, STEP, VT, LOAD, DOT)                                           \
    static inline void NAME(const WT* const* wr, const WT* x, int64_t K, int64_t m,          \
                            void* y, int64_t N, int64_t n0, int rows, Prefetch* pf,          \
                            int out_bf16) {                                                  \
        __m512 acc[MR][R];                                                                   \
        for (int i = 0; i < MR; i++)                                                         \
            for (int j = 0; j < R; j++) acc[i][j] = _mm512_setzero_ps();                     \
        for (int64_t k = 0; k < K; k += STEP) {                                              \
            prefetch_step_l2(pf);                                                            \
            VT wv[R];                                                                        \
            for (int j = 0; j < R; j++) wv[j] = LOAD(wr[j] + k);                             \
            for (int i = 0; i < MR; i++) {                                                   \
                VT xv = LOAD(x + (m + i) * K + k);                                           \
                for (int j = 0; j < R; j++) acc[i][j] = DOT(acc[i][j], wv[j], xv);           \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < MR; i++)                                                         \
            for (int j = 0; j < rows; j++)                                                   \
                store(y, (m + i) * N + n0 + j, _mm512_reduce_add_ps(acc[i][j]), out_bf16);  \
    }

/* The tiles and the driver for one weight type. */
#define GEMV512(NAME, WT, STEP, VT, LOAD, DOT)                                               \
    TILE(NAME##_8x1, 8, 1, WT, STEP, VT, LOAD, DOT)                                         \
    TILE(NAME##_8x2, 8, 2, WT, STEP, VT, LOAD, DOT)                                         \
    TILE(NAME##_4x1, 4, 1, WT, STEP, VT, LOAD, DOT)                                         \
    TILE(NAME##_4x2, 4, 2, WT, STEP, VT, LOAD, DOT)                                         \
    TILE(NAME##_4x3, 4, 3, WT, STEP, VT, LOAD, DOT)                                         \
    TILE(NAME##_4x4, 4, 4, WT, STEP, VT, LOAD, DOT)                                         \
    ROWS_IN_TURN(NAME##_turn1, 1, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn2, 2, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn3, 3, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn4, 4, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn5, 5, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn6, 6, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn7, 7, WT, STEP, VT, LOAD, DOT)                                  \
    ROWS_IN_TURN(NAME##_turn8, 8, WT, STEP, VT, LOAD, DOT)                                  \
    static void (*const NAME##_turns[8])(const WT*, const WT*, int64_t, void*, int64_t,     \
                                         int64_t, int, const char*, int) = {                \
        NAME##_turn1, NAME##_turn2, NAME##_turn3, NAME##_turn4,                             \
        NAME##_turn5, NAME##_turn6, NAME##_turn7, NAME##_turn8};                            \
    /* Input rows [0, M) against a half block (at most 4 weight rows), 4 at a time. */      \
    static void NAME##_half(const WT* const* wr, const WT* x, int64_t M, int64_t K, void* y, \
                            int64_t N, int64_t n0, int rows, Prefetch* pf, int out_bf16) {  \
        int64_t m = 0;                                                                      \
        for (; m + 4 <= M; m += 4) NAME##_4x4(wr, x, K, m, y, N, n0, rows, pf, out_bf16);   \
        if (M - m == 3) NAME##_4x3(wr, x, K, m, y, N, n0, rows, pf, out_bf16);              \
        if (M - m == 2) NAME##_4x2(wr, x, K, m, y, N, n0, rows, pf, out_bf16);              \
        if (M - m == 1) NAME##_4x1(wr, x, K, m, y, N, n0, rows, pf, out_bf16);              \
    }                                                                                       \
    void NAME(const WT* x, const WT* w, void* y, int64_t M, int64_t N, int64_t K,           \
              int out_bf16) {                                                               \
        int64_t blocks = (N + 7) / 8, block_bytes = 8 * K * (int64_t)sizeof(WT);            \
        int64_t passes = M <= 2 ? 1 : 2 * ((M + 3) / 4); /* k loops a block takes */        \
        Share shares[SHARE_MAX] __attribute__((aligned(64)));                               \
        int parts = share_parts(), in_turn = M >= 1 && M <= 8 && gemv512_rows_in_turn;      \
        const char* stop = (const char*)(w + N * K);                                        \
        shares_init(shares, parts, blocks);                                                 \
        _Pragma("omp parallel")                                                             \
        for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {      \
            int64_t n0 = b * 8;                                                             \
            int rows = N - n0 < 8 ? (int)(N - n0) : 8;                                      \
            if (in_turn) {                                                                  \
                NAME##_turns[M - 1](w, x, K, y, N, n0, rows, stop, out_bf16);               \
                continue;                                                                   \
            }                                                                               \
            const WT* wr[8];                                                                \
            for (int j = 0; j < 8; j++) wr[j] = w + (n0 + (j < rows ? j : 0)) * K;          \
            Prefetch pf = {ahead(wr[0], block_bytes, n0 + 8 * PF_BLOCKS < N),               \
                           block_bytes / 64, K / STEP * passes, 0, 0};                      \
            if (M == 1)                                                                     \
                NAME##_8x1(wr, x, K, 0, y, N, n0, rows, &pf, out_bf16);                     \
            else if (M == 2)                                                                \
                NAME##_8x2(wr, x, K, 0, y, N, n0, rows, &pf, out_bf16);                     \
            else                                                                            \
                for (int h = 0; h < 2 && 4 * h < rows; h++)                                 \
                    NAME##_half(wr + 4 * h, x, M, K, y, N, n0 + 4 * h,                      \
                                rows - 4 * h < 4 ? rows - 4 * h : 4, &pf, out_bf16);        \
        }                                                                                   \
    }

/* fp32 x and weights; K % 16 == 0. */
#define LOAD_F32(p) _mm512_loadu_ps(p)
#define FMA_F32(acc, a, b) _mm512_fmadd_ps(a, b, acc)
GEMV512(gemv512_f32, float, 16, __m512, LOAD_F32, FMA_F32)

#ifdef __AVX512BF16__
/* bf16 x and weights, native bf16 dot products; K % 32 == 0. */
#define LOAD_BF16(p) ((__m512bh)_mm512_loadu_si512(p))
#define DOT_BF16(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
GEMV512(gemv512_bf16, uint16_t, 32, __m512bh, LOAD_BF16, DOT_BF16)
#else
/* AVX-512 without bf16 dot products: bf16 x and weights widened to fp32 (the same exact
   products, fp32 sums); K % 32 == 0 as above (the loop steps by 16). */
#define LOAD_WIDE(p)                                                                         \
    _mm512_castsi512_ps(                                                                     \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
GEMV512(gemv512_bf16, uint16_t, 16, __m512, LOAD_WIDE, FMA_F32)
#endif
