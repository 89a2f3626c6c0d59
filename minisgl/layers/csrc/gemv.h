/* The bf16 GEMV's pieces (gemv.c), shared with the mixture-of-experts decode (moe.c): a caller
   that runs them on the same rows gets the same bits as gemv_bf16. */
#pragma once
#include "common.h"

/* x rows [M, K] (fp32, or bf16 where x_bf16) -> xs [M, K] fp32, each 16-block's even features
   then its odd ones: the order gemv_bf16_block's weight vectors come in (no shuffle). */
static inline void gemv_bf16_split_x(const void* x, int x_bf16, float* xs, int64_t M,
                                     int64_t K) {
    const float* xf = (const float*)x;
    const uint16_t* xb = (const uint16_t*)x;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)
            for (int j = 0; j < 8; j++) {
                int64_t e = m * K + k + 2 * j;
                xs[m * K + k + j] = x_bf16 ? bf16_to_f32(xb[e]) : xf[e];
                xs[m * K + k + 8 + j] = x_bf16 ? bf16_to_f32(xb[e + 1]) : xf[e + 1];
            }
}

/* Weight rows w[0 .. rows) (rows <= 4, K apart) against the split rows xs [M, K]: row m's
   product with weight row j goes to y[(y_row + m) * ld + col + j]. bf16 weights: 16 at a time
   with one load, no shuffle: a 32-bit lane holds two bf16; shifting left by 16 gives the even
   element as fp32, masking the low half gives the odd one. K % 16 == 0. `pf` advances one
   step per k-step of every pass (prefetch_step). */
static inline __attribute__((always_inline)) void gemv_bf16_block(
    const float* xs, const uint16_t* w, int rows, void* y, int64_t y_row, int64_t ld,
    int64_t col, int64_t M, int64_t K, Prefetch* pf, int out_bf16) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const uint16_t* wr[4];
    for (int j = 0; j < 4; j++) wr[j] = w + (j < rows ? j : 0) * K;
    /* Two input rows per pass: each weight vector is converted once for both. Even and odd
       halves share an accumulator (x is pre-split to match). */
    int64_t m = 0;
    for (; m + 1 < M; m += 2) {
        const float* x0 = xs + m * K;
        const float* x1 = x0 + K;
        __m256 a[4], c[4];
        for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            prefetch_step(pf);
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(wr[j] + k));
                __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                a[j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(x0 + k), a[j]);
                c[j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(x1 + k), c[j]);
                a[j] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(x0 + k + 8), a[j]);
                c[j] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(x1 + k + 8), c[j]);
            }
        }
        for (int j = 0; j < rows; j++) {
            store(y, (y_row + m) * ld + col + j, hsum(a[j]), out_bf16);
            store(y, (y_row + m + 1) * ld + col + j, hsum(c[j]), out_bf16);
        }
    }
    for (; m < M; m++) {
        const float* xm = xs + m * K;
        __m256 a[4], c[4];
        for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            prefetch_step(pf);
            __m256 xe = _mm256_loadu_ps(xm + k), xo = _mm256_loadu_ps(xm + k + 8);
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(wr[j] + k));
                __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                a[j] = _mm256_fmadd_ps(we, xe, a[j]);
                c[j] = _mm256_fmadd_ps(wo, xo, c[j]);
            }
        }
        for (int j = 0; j < rows; j++)
            store(y, (y_row + m) * ld + col + j, hsum(_mm256_add_ps(a[j], c[j])), out_bf16);
    }
}

/* gemv_bf16's prefetch for a block of 4 rows of K bf16 against M input rows: `next` is where
   the block PF_BLOCKS ahead starts (0: none), its lines spread over all of this block's k-steps
   (common.h). */
static inline Prefetch gemv_bf16_prefetch(const void* next, int64_t M, int64_t K) {
    Prefetch pf = {(const char*)next, K / 8, K / 16 * ((M + 1) / 2), 0, 0};
    return pf;
}
