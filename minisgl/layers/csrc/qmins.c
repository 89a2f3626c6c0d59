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

static float dot(const float* a, const float* b, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum(s);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* 1, or 0 where it computed nothing (no memory for the sums of x). */
int qmins(const void* x, int x_bf16, const float* acc, const float* mins, int64_t gstride,
          void* y, int y_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    const int64_t G = K / gs;
    float* xs = malloc(sizeof(float) * (size_t)(M * G));
    if (!xs) return 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) xs[m * G + g] = group_sum(x, x_bf16, m * K + g * gs, gs);
    /* split over the threads from norm_parallel_min values (measured when the library loads,
       elementwise.c), as a norm's rows: both read each value once for a few flops */
    #pragma omp parallel for schedule(static) if (M * N * G >= norm_parallel_min)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            store(y, m * N + n, acc[m * N + n] - dot(mins + n * gstride, xs + m * G, G), y_bf16);
    free(xs);
    return 1;
}
