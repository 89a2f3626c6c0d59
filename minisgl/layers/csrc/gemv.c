/* GEMV for decode-sized inputs (a few rows against a large weight), AVX2. */
#include "gemv.h"

/* Four weight rows against one or two input rows; K % 8 == 0. */
#define GEMV(NAME, WT, LOAD)                                                                  \
void NAME(const float* x, const WT* w, void* y, int64_t M, int64_t N, int64_t K,            \
          int out_bf16) {                                                                   \
    int64_t blocks = (N + 3) / 4;                                                           \
    Share shares[SHARE_MAX] __attribute__((aligned(64)));                                   \
    int parts = share_parts();                                                              \
    shares_init(shares, parts, blocks);                                                     \
    _Pragma("omp parallel")                                                                 \
    for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {          \
        int64_t n0 = b * 4;                                                                 \
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;                                          \
        const WT* w0 = w + n0 * K;                                                          \
        const WT* w1 = rows > 1 ? w0 + K : w0;                                              \
        const WT* w2 = rows > 2 ? w0 + 2 * K : w0;                                          \
        const WT* w3 = rows > 3 ? w0 + 3 * K : w0;                                          \
        int64_t block_bytes = 4 * K * (int64_t)sizeof(WT);                                  \
        Prefetch pf = {ahead(w0, block_bytes, n0 + 4 * PF_BLOCKS < N), block_bytes / 64,    \
                       K / 8 * ((M + 1) / 2), 0, 0};                                        \
        for (int64_t m = 0; m < M; m += 2) {                                                \
            const float* x0 = x + m * K;                                                    \
            float r[2][4];                                                                  \
            if (m + 1 < M) {                                                                \
                const float* x1 = x0 + K;                                                   \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                  \
                for (int64_t k = 0; k < K; k += 8) {                                        \
                    prefetch_step(&pf);                                                     \
                    __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);        \
                    __m256 c0 = LOAD(w0 + k), c1 = LOAD(w1 + k);                            \
                    __m256 c2 = LOAD(w2 + k), c3 = LOAD(w3 + k);                            \
                    a0 = _mm256_fmadd_ps(c0, u, a0); b0 = _mm256_fmadd_ps(c0, v, b0);       \
                    a1 = _mm256_fmadd_ps(c1, u, a1); b1 = _mm256_fmadd_ps(c1, v, b1);       \
                    a2 = _mm256_fmadd_ps(c2, u, a2); b2 = _mm256_fmadd_ps(c2, v, b2);       \
                    a3 = _mm256_fmadd_ps(c3, u, a3); b3 = _mm256_fmadd_ps(c3, v, b3);       \
                }                                                                           \
                r[0][0] = hsum(a0); r[0][1] = hsum(a1); r[0][2] = hsum(a2);                 \
                r[0][3] = hsum(a3); r[1][0] = hsum(b0); r[1][1] = hsum(b1);                 \
                r[1][2] = hsum(b2); r[1][3] = hsum(b3);                                     \
            } else {                                                                        \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                for (int64_t k = 0; k < K; k += 8) {                                        \
                    prefetch_step(&pf);                                                     \
                    __m256 u = _mm256_loadu_ps(x0 + k);                                     \
                    a0 = _mm256_fmadd_ps(LOAD(w0 + k), u, a0);                              \
                    a1 = _mm256_fmadd_ps(LOAD(w1 + k), u, a1);                              \
                    a2 = _mm256_fmadd_ps(LOAD(w2 + k), u, a2);                              \
                    a3 = _mm256_fmadd_ps(LOAD(w3 + k), u, a3);                              \
                }                                                                           \
                r[0][0] = hsum(a0); r[0][1] = hsum(a1);                                     \
                r[0][2] = hsum(a2); r[0][3] = hsum(a3);                                     \
            }                                                                               \
            for (int i = 0; i < 2 && m + i < M; i++)                                        \
                for (int j = 0; j < rows; j++)                                              \
                    store(y, (m + i) * N + n0 + j, r[i][j], out_bf16);                      \
        }                                                                                   \
    }                                                                                       \
}

GEMV(gemv_f32, float, load_f32)

/* bf16 weights (gemv.h's block kernel). x is pre-split into even/odd halves per 16-block to
   match. K % 16 == 0. x is fp32, or bf16 where x_bf16 (converted in the split: no separate pass
   over x). */
void gemv_bf16(const void* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
               int out_bf16, int x_bf16) {
    float* xs = (float*)malloc(sizeof(float) * M * K);
    gemv_bf16_split_x(x, x_bf16, xs, M, K);
    int64_t blocks = (N + 3) / 4;
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(shares, parts, blocks);
    #pragma omp parallel
    for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
        int64_t n0 = b * 4;
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        Prefetch pf = gemv_bf16_prefetch(ahead(w + n0 * K, 4 * K * 2, n0 + 4 * PF_BLOCKS < N),
                                         M, K);
        gemv_bf16_block(xs, w + n0 * K, rows, y, 0, N, n0, M, K, &pf, out_bf16);
    }
    free(xs);
}
