/* AVX-512 GEMV, only in the AVX-512 build: y[M, N] = x[M, K] @ W[N, K].T for small M.
   At one row decode is bound by memory bandwidth and the AVX2 GEMV is as good; at 2-16 rows the
   AVX2 one becomes bound by its FMAs (8 lanes, and two conversions per 16 bf16 weights), which
   is where this one helps: 16 lanes, and with AVX512-BF16 one VDPBF16PS does 32 bf16 products
   per input row straight from the packed weights (x must then be bf16 too: exact products,
   fp32 sums, as oneDNN's bf16 path). A block is 4 weight rows against up to 4 input rows
   (16 accumulators of the 32 registers); the block's rows stay in L1 while further groups of
   4 input rows pass over them, so the weights are read from memory once. */
#include "common.h"

static inline void store_block(void* y, int64_t N, int64_t m, int64_t n0, int mr, int rows,
                               __m512 acc[4][4], int out_bf16) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < rows; j++)
            store(y, (m + i) * N + n0 + j, _mm512_reduce_add_ps(acc[i][j]), out_bf16);
}

#define GEMV512_BODY(WT, STEP, ZERO_LOAD_FMA)                                                 \
    int64_t blocks = (N + 3) / 4;                                                           \
    _Pragma("omp parallel for schedule(static)")                                            \
    for (int64_t b = 0; b < blocks; b++) {                                                  \
        int64_t n0 = b * 4;                                                                 \
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;                                          \
        const WT* wr[4];                                                                    \
        for (int j = 0; j < 4; j++) wr[j] = w + (n0 + (j < rows ? j : 0)) * K;              \
        const char* pf = ahead(w + n0 * K, 4 * K * (int64_t)sizeof(WT), n0 + 4 * PF_BLOCKS < N); \
        for (int64_t m = 0; m < M; m += 4) {                                                \
            int mr = M - m < 4 ? (int)(M - m) : 4;                                          \
            const WT* xr[4];                                                                \
            for (int i = 0; i < 4; i++) xr[i] = x + (m + (i < mr ? i : 0)) * K;             \
            __m512 acc[4][4];                                                               \
            for (int i = 0; i < 4; i++)                                                     \
                for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();                \
            for (int64_t k = 0; k < K; k += STEP) {                                         \
                if (m == 0 && pf) prefetch_lines(pf, k * 4 * (int64_t)sizeof(WT), 4);        \
                ZERO_LOAD_FMA                                                               \
            }                                                                               \
            store_block(y, N, m, n0, mr, rows, acc, out_bf16);                              \
        }                                                                                   \
    }

/* fp32 x and weights; K % 16 == 0. */
void gemv512_f32(const float* x, const float* w, void* y, int64_t M, int64_t N, int64_t K,
                 int out_bf16) {
    GEMV512_BODY(float, 16, {
        __m512 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_ps(wr[j] + k);
        for (int i = 0; i < 4; i++) {
            __m512 xv = _mm512_loadu_ps(xr[i] + k);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    })
}

#ifdef __AVX512BF16__
/* bf16 x and weights, native bf16 dot products; K % 32 == 0. */
void gemv512_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N,
                  int64_t K, int out_bf16) {
    GEMV512_BODY(uint16_t, 32, {
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
        for (int i = 0; i < 4; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[i] + k);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    })
}
#else
/* AVX-512 without bf16 dot products: bf16 x and weights widened to fp32 (the same exact
   products, fp32 sums); K % 32 == 0 as above. */
void gemv512_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N,
                  int64_t K, int out_bf16) {
    GEMV512_BODY(uint16_t, 16, {
        __m512 wv[4];
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wr[j] + k))), 16));
        for (int i = 0; i < 4; i++) {
            __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr[i] + k))), 16));
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    })
}
#endif
