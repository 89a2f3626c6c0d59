/* The group mins' term of a quantized weight whose groups carry a float min (GGUF's Q4_K and
   Q5_K: weight = (code - zero) * scale - min), after an integer kernel computed the rest into
   fp32:

       y[m, n] = acc[m, n] - sum_g min[n, g] * xsum[m, g],   xsum[m, g] = sum of x[m, k in g]

   x [M, K] (bf16 or fp32, as the kernels take it), mins [N, G] fp32 (row stride gstride), y in
   fp32 or bf16 (rounded once, to the nearest even); y may be acc itself. The same call serves
   the layer-by-layer path (minisgl/quant/matmul.py) and the decode chain (chain.c's OP_MINS),
   so both give the same bits. One fp32 multiply-add per min: a fifth of a 4-bit weight's
   bytes (4 per 32 weights against 16 of codes) on top of its matmul. */
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

/* One row of mins against one row of x's group sums: 8 lanes, lane l summing groups g = l
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

/* mins_dot for rows n0 .. n0 + rows - 1 (rows <= 8) at once, the same bits: eight FMA chains
   in flight, then one reduction for the eight rows in sum_pairs' order. The sums as one
   vector (rows past `rows`: 0). */
static inline __m256 mins_dot8(const float* mins, int64_t gstride, int64_t n0, int rows,
                               const float* xs, int64_t G) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    const int64_t whole = G / 8 * 8;
    for (int64_t g = 0; g < whole; g += 8) {
        __m256 xv = _mm256_loadu_ps(xs + g);
        for (int j = 0; j < rows; j++) /* 8 but in the last block (qmins) */
            a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + (n0 + j) * gstride + g), xv, a[j]);
    }
    if (whole < G) {
        __m256i mask = tail_mask(G);
        __m256 xv = _mm256_maskload_ps(xs + whole, mask);
        for (int j = 0; j < rows; j++)
            a[j] = _mm256_fmadd_ps(_mm256_maskload_ps(mins + (n0 + j) * gstride + whole, mask),
                                   xv, a[j]);
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

/* y[m, n0 .. n0 + rows - 1] = acc - the rows' sums against rows m0 .. m1 - 1 of x (the
   block's mins stay in L1 across the rows of x). A whole block's eight outputs are one
   vector's subtraction and rounding (the same bits as `store` one by one). */
static inline void mins_block(const float* mins, int64_t gstride, int64_t n0, int rows,
                              const float* xs, int64_t G, const float* acc, void* y,
                              int y_bf16, int64_t m0, int64_t m1, int64_t N) {
    for (int64_t m = m0; m < m1; m++) {
        __m256 sums = mins_dot8(mins, gstride, n0, rows, xs + m * G, G);
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

#define MINS_ROWS 64 /* rows of x a run (mins_block's m0 .. m1): 8 KB of sums at G = 32 */

/* 1, or 0 where it computed nothing (no memory for the sums of x).

   One row of x takes the mins row by row (a plain stream, which the hardware prefetcher
   follows best: 1.05-1.3x faster from memory than eight rows side by side); more rows take
   eight rows of mins at a time against each row of x, eight FMA chains and one reduction
   for the eight, the same bits. Before, every (row of x, row of mins) pair took its own dot
   and horizontal sum: 13-14 ms for a 512-token prefill's 6144x1024 Q4_K weight, about a
   third of the prefill (AMD EPYC Zen 4, 2 threads). The runs of rows and store8 then took
   it 1.1-1.23x faster at 1024 rows, 1.14-1.67x at 64, 1.2-1.47x at 8 (6144x1024, 4096x1024,
   1024x3072 in groups of 32, bf16 x and y, the two builds alternating, same Zen 4). */
int qmins(const void* x, int x_bf16, const float* acc, const float* mins, int64_t gstride,
          void* y, int y_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    const int64_t G = K / gs, blocks = (N + 7) / 8;
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
        if (M == 1) {
            #pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                store(y, n, acc[n] - mins_dot(mins + n * gstride, xs, G), y_bf16);
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
                /* the same call twice: with a constant 8 the compiler unrolls the 8 chains */
                if (rows == 8)
                    mins_block(mins, gstride, b * 8, 8, xs, G, acc, y, y_bf16, m0, m1, N);
                else
                    mins_block(mins, gstride, b * 8, rows, xs, G, acc, y, y_bf16, m0, m1, N);
            }
        }
    }
    free(xs);
    return 1;
}
