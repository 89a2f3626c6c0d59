/* The group mins' term of a quantized weight whose groups carry a float min (GGUF's Q4_K and
   Q5_K: weight = (code - zero) * scale - min), after an integer kernel computed the rest into
   fp32:

       y[m, n] = acc[m, n] - sum_g min[n, g] * xsum[m, g],   xsum[m, g] = sum of x[m, k in g]

   x [M, K] (bf16 or fp32, as the kernels take it), mins as common.h's Mins holds them (fp32,
   or a K-quant's u8 m with its super-blocks' dmin), y in fp32 or bf16 (rounded once, to the
   nearest even); y may be acc itself. The same call serves the layer-by-layer path
   (minisgl/quant/matmul.py) and the decode chain (chain.c's OP_MINS), so both give the same
   bits. One fp32 multiply-add per min, on top of the matmul a read of 1 + 4 / per bytes per
   32 weights in the compact form (1.5 for Q4_K against 16 of codes), 4 in fp32. */
#include "common.h"

/* x[at .. at + gs) summed in fp32, 8 lanes then across (gs % 8 == 0: groups of 32n). */
static float group_sum(const void* x, int x_bf16, int64_t at, int64_t gs) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t k = 0; k < gs; k += 8)
        s = _mm256_add_ps(s, x_bf16 ? load_bf16((const uint16_t*)x + at + k)
                                    : load_f32((const float*)x + at + k));
    return hsum(s);
}

/* The lanes of the last G % 8 groups (mins_dot's masked loads). */
static inline __m256i tail_mask(int64_t G) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(G % 8)), lanes);
}

/* A row's 8 lanes summed in pairs, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the
   order mins_dot8 adds eight rows' lanes in at once. */
static inline float sum_pairs(__m256 a) {
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* One row of fp32 mins against one row of x's group sums: 8 lanes, lane l summing groups g = l
   mod 8 in g's order (the last G % 8 groups masked in), then sum_pairs. */
static inline float mins_dot(const float* mins, const float* xs, int64_t G) {
    __m256 a = _mm256_setzero_ps();
    const int64_t whole = G / 8 * 8;
    for (int64_t g = 0; g < whole; g += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xs + g), a);
    if (whole < G) {
        __m256i mask = tail_mask(G);
        a = _mm256_fmadd_ps(_mm256_maskload_ps(mins + whole, mask),
                            _mm256_maskload_ps(xs + whole, mask), a);
    }
    return sum_pairs(a);
}

/* mins_dot for rows r0 .. r0 + rows - 1 of mins (rows <= 8) at once, the same bits: eight FMA
   chains in flight, then one reduction for the eight rows in sum_pairs' order. The sums as one
   vector (rows past `rows`: 0). */
static inline __attribute__((always_inline)) __m256 mins_dot8(const Mins* mins, int64_t r0,
                                                               int rows, const float* xs,
                                                               int64_t G, const int compact) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    const int64_t whole = G / 8 * 8;
    for (int64_t g = 0; g < whole; g += 8) {
        __m256 xv = _mm256_loadu_ps(xs + g);
        for (int j = 0; j < rows; j++) /* 8 but in the last block (qmins) */
            a[j] = _mm256_fmadd_ps(min8(mins, r0 + j, g, compact), xv, a[j]);
    }
    if (whole < G) { /* fp32 mins only: the compact form's G is whole super-blocks */
        __m256i mask = tail_mask(G);
        __m256 xv = _mm256_maskload_ps(xs + whole, mask);
        const float* m = (const float*)mins->m + r0 * mins->stride + whole;
        for (int j = 0; j < rows; j++)
            a[j] = _mm256_fmadd_ps(_mm256_maskload_ps(m + j * mins->stride, mask), xv, a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* rows 0-3 | 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* y[at .. at + 8) = acc[at ..] - sums, as `store` rounds each (to bf16: the nearest, ties
   to even; y may be acc). */
static inline void store8(void* y, int64_t at, const float* acc, __m256 sums, int y_bf16) {
    __m256 v = _mm256_sub_ps(_mm256_loadu_ps(acc + at), sums);
    if (!y_bf16) {
        _mm256_storeu_ps((float*)y + at, v);
        return;
    }
    __m256i b = _mm256_srli_epi32(bias8_bf16(v), 16); /* 0 .. 0xFFFF: packus keeps them */
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i*)((uint16_t*)y + at), h);
}

/* y[m, n0 .. n0 + rows - 1] = acc - the sums of rows r0 .. r0 + rows - 1 of mins (they stay
   in L1 across the rows of x) against rows m0 .. m1 - 1 of x. A whole block's eight outputs
   are one vector's subtraction and rounding (the same bits as `store` one by one). */
static inline __attribute__((always_inline)) void mins_block(
    const Mins* mins, int64_t r0, int64_t n0, int rows, const float* xs, int64_t G,
    const float* acc, void* y, int y_bf16, int64_t m0, int64_t m1, int64_t N, const int compact) {
    for (int64_t m = m0; m < m1; m++) {
        __m256 sums = mins_dot8(mins, r0, rows, xs + m * G, G, compact);
        if (rows == 8) {
            store8(y, m * N + n0, acc, sums, y_bf16);
            continue;
        }
        float sum[8];
        _mm256_storeu_ps(sum, sums);
        for (int j = 0; j < rows; j++)
            store(y, m * N + n0 + j, acc[m * N + n0 + j] - sum[j], y_bf16);
    }
}

#define MINS_EXPAND_MAX 2048 /* groups a block of compact mins expands on the stack: 64 KB */
#define MINS_ROWS 64 /* rows of x a run (mins_block's m0 .. m1): 8 KB of sums at G = 32 */

/* 1, or 0 where it computed nothing (no memory for the sums of x).

   One row of x takes the mins row by row (a plain stream, which the hardware prefetcher
   follows best: 1.05-1.3x faster from memory than eight rows side by side); more rows take
   eight rows of mins at a time against each row of x, eight FMA chains and one reduction
   for the eight, the same bits. Before, every (row of x, row of mins) pair took its own dot
   and horizontal sum: 13-14 ms for a 512-token prefill's 6144x1024 Q4_K weight, about a
   third of the prefill (AMD EPYC Zen 4, 2 threads). The runs of rows and store8 then took
   it 1.1-1.23x faster at 1024 rows, 1.14-1.67x at 64, 1.2-1.47x at 8 (6144x1024, 4096x1024,
   1024x3072 in groups of 32, bf16 x and y, the two builds alternating, same Zen 4).

   mins: fp32 [N, G] (mscale null), or u8 m [N, G] with fp32 dmin mscale [N, G / per] (row
   strides gstride and sstride; per 8 or 16, G % per == 0). The compact form takes eight rows
   at a time at one row of x too (their bytes one short run), and at more rows turns each
   block's mins to fp32 once per run of rows of x (converted inline, per row of x, 8 rows took
   2.5-3.4x as long). A 6144x1024 Q4_K weight's term from memory (28 weights in turn, the forms
   alternating in one process, AMD EPYC Zen 4, 2 threads, the AVX-512 build; AVX2 alike): one
   row 12.1 us compact, 17.6 fp32; 8 rows 38.3 and 68.2; 64 rows 202 and 263. */
int qmins(const void* x, int x_bf16, const float* acc, const void* mins, int64_t gstride,
          const float* mscale, int64_t sstride, int64_t per, void* y, int y_bf16, int64_t M,
          int64_t N, int64_t K, int64_t gs) {
    const int64_t G = K / gs, blocks = (N + 7) / 8;
    const Mins mn = mins_of(mins, gstride, mscale, sstride, per);
    /* compact mins at more than one row of x: each block of eight rows turned to fp32 once
       per run of rows of x, on the thread's stack (a buffer beside xs on the heap ran 1.5x
       slower at 64 rows) */
    const int expand = mscale && G <= MINS_EXPAND_MAX;
    float* xs = malloc(sizeof(float) * (size_t)(M * G));
    if (!xs) return 0;
    /* split over the threads from norm_parallel_min values (measured when the library loads,
       elementwise.c), as a norm's rows: both read each value once for a few flops */
    #pragma omp parallel if (M * N * G >= norm_parallel_min)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < G; g++)
                xs[m * G + g] = group_sum(x, x_bf16, m * K + g * gs, gs);
        if (M == 1 && !mscale) {
            #pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                store(y, n, acc[n] - mins_dot((const float*)mins + n * gstride, xs, G),
                      y_bf16);
        } else if (M == 1) {
            /* compact mins: eight rows at a time (their bytes one short run of 8 x G), one
               reduction for the eight where row by row took one each */
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                int rows = N - b * 8 < 8 ? (int)(N - b * 8) : 8;
                if (rows == 8)
                    mins_block(&mn, b * 8, b * 8, 8, xs, G, acc, y, y_bf16, 0, 1, N, 1);
                else
                    mins_block(&mn, b * 8, b * 8, rows, xs, G, acc, y, y_bf16, 0, 1, N, 1);
            }
        } else {
            /* the rows of x in runs of MINS_ROWS, each over every block of mins: a run's sums
               of x stay in L1 and its lines of acc and y (two blocks share one) in L2 from one
               block to the next, where all rows of x per block left them to farther caches */
            const int64_t runs = (M + MINS_ROWS - 1) / MINS_ROWS;
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < runs * blocks; t++) {
                int64_t b = t % blocks, m0 = t / blocks * MINS_ROWS;
                int64_t m1 = M - m0 < MINS_ROWS ? M : m0 + MINS_ROWS;
                int rows = N - b * 8 < 8 ? (int)(N - b * 8) : 8;
                if (mscale && !expand) { /* more groups than the stack takes: inline */
                    mins_block(&mn, b * 8, b * 8, rows, xs, G, acc, y, y_bf16, m0, m1, N, 1);
                    continue;
                }
                float buf[expand ? 8 * G : 1];
                Mins block = mn;
                int64_t r0 = b * 8;
                if (expand) {
                    for (int j = 0; j < rows; j++)
                        for (int64_t g = 0; g < G; g += 8)
                            _mm256_storeu_ps(buf + j * G + g, min8(&mn, b * 8 + j, g, 1));
                    block = (Mins){buf, 0, G, 0, 0}, r0 = 0;
                }
                /* the same call twice: with a constant 8 the compiler unrolls the 8 chains */
                if (rows == 8)
                    mins_block(&block, r0, b * 8, 8, xs, G, acc, y, y_bf16, m0, m1, N, 0);
                else
                    mins_block(&block, r0, b * 8, rows, xs, G, acc, y, y_bf16, m0, m1, N, 0);
            }
        }
    }
    free(xs);
    return 1;
}
