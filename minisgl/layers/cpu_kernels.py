"""Small AVX2 kernels for CPU inference, where eager PyTorch leaves most of the time on the table.

- gemv: y[M, N] = x[M, K] @ W[N, K].T for small M. Decode streams every weight once per step,
  so its speed is memory bandwidth; on CPUs without AVX-512, torch's bf16 path (and oneDNN's,
  which refuses bf16 there) reads weights at a fraction of it. The kernel converts bf16 to fp32
  with a shift, accumulates in fp32 with FMAs, keeps four weight rows times two input rows in
  registers, and splits output rows across threads.
- gemm: the same product for many rows (batched decode, prefill): W converted to fp32 a
  16-row panel at a time, then a 6x16 register-blocked micro-kernel. torch's bf16 matmul on
  AVX2 (no native bf16) runs ~7 GFLOP/s; this one runs at torch's fp32 speed (~75 per core)
  without an fp32 copy of the weights.
- decode attention: one query per request straight over the paged pool (slot indices, no
  gather copy), scores/softmax/weighted sum in fp32. torch's CPU SDPA spends ~0.5 ms per call
  on a single query, more than the layer's matmuls.
All use torch's own OpenMP threads (they link the libgomp torch already loaded).

Built once with the system C compiler into a per-user cache and loaded with ctypes; anything
missing (no compiler, no AVX2, MINISGL_CPU_KERNELS=0) means `load()` returns None and callers
keep their PyTorch path. Results match F.linear to fp32 rounding (the summation order differs).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Up to this many input rows the GEMV (weights streamed once, two x rows per pass) is faster;
# beyond it the blocked GEMM (measured at 1024x6144, bf16 and fp32: GEMM ahead from ~20 rows).
MAX_ROWS = 16

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdlib.h>

static inline __m256 load_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void store(void* y, int64_t i, float v, int out_bf16) {
    if (out_bf16) {
        uint32_t b;
        __builtin_memcpy(&b, &v, 4);
        b += 0x7FFF + ((b >> 16) & 1); /* round to nearest even */
        ((uint16_t*)y)[i] = (uint16_t)(b >> 16);
    } else {
        ((float*)y)[i] = v;
    }
}

/* Weights are streamed from memory once per call in 4-row blocks, and each block's rows are
   short streams (2 KB at K=1024) that the hardware prefetcher barely learns before they end:
   reading PF_BLOCKS blocks ahead by hand keeps the memory busy while the current block is
   multiplied (measured: M=1 from ~20 to ~25 GB/s; M=8 no longer pays memory and FMA time one
   after the other). */
#define PF_BLOCKS 2
static inline const char* ahead(const void* block, int64_t block_bytes, int ok) {
    return ok ? (const char*)block + PF_BLOCKS * block_bytes : 0;
}
/* `n` cache lines from byte `off` of `base`: one k step consumes 4 rows x its bytes, so the
   prefetch advances through the next blocks as fast as the current one is read. */
static inline void prefetch_lines(const char* base, int64_t off, int n) {
    for (int i = 0; i < n; i++) _mm_prefetch(base + off + 64 * i, _MM_HINT_T0);
}

/* Four weight rows against one or two input rows; K % 8 == 0. */
#define GEMV(NAME, WT, LOAD)                                                                  \
void NAME(const float* x, const WT* w, void* y, int64_t M, int64_t N, int64_t K,            \
          int out_bf16) {                                                                   \
    int64_t blocks = (N + 3) / 4;                                                           \
    _Pragma("omp parallel for schedule(static)")                                            \
    for (int64_t b = 0; b < blocks; b++) {                                                  \
        int64_t n0 = b * 4;                                                                 \
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;                                          \
        const WT* w0 = w + n0 * K;                                                          \
        const WT* w1 = rows > 1 ? w0 + K : w0;                                              \
        const WT* w2 = rows > 2 ? w0 + 2 * K : w0;                                          \
        const WT* w3 = rows > 3 ? w0 + 3 * K : w0;                                          \
        const char* pf = ahead(w0, 4 * K * (int64_t)sizeof(WT), n0 + 4 * PF_BLOCKS < N);      \
        for (int64_t m = 0; m < M; m += 2) {                                                \
            const float* x0 = x + m * K;                                                    \
            float r[2][4];                                                                  \
            if (m + 1 < M) {                                                                \
                const float* x1 = x0 + K;                                                   \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                  \
                for (int64_t k = 0; k < K; k += 8) {                                        \
                    if (m == 0 && pf) prefetch_lines(pf, k * 4 * (int64_t)sizeof(WT), 2);    \
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
                    if (m == 0 && pf) prefetch_lines(pf, k * 4 * (int64_t)sizeof(WT), 2);    \
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

/* bf16 weights: 16 at a time with one load, no shuffle: a 32-bit lane holds two bf16; shifting
   left by 16 gives the even element as fp32, masking the low half gives the odd one. x is
   pre-split into even/odd halves per 16-block to match. K % 16 == 0. */
void gemv_bf16(const float* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
               int out_bf16) {
    float* xs = (float*)malloc(sizeof(float) * M * K);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)
            for (int j = 0; j < 8; j++) {
                xs[m * K + k + j] = x[m * K + k + 2 * j];
                xs[m * K + k + 8 + j] = x[m * K + k + 2 * j + 1];
            }
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    int64_t blocks = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * 4;
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        const uint16_t* wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (n0 + (j < rows ? j : 0)) * K;
        const char* pf = ahead(w + n0 * K, 4 * K * 2, n0 + 4 * PF_BLOCKS < N);
        /* Two input rows per pass: each weight vector is converted once for both. Even and
           odd halves share an accumulator (x is pre-split to match). */
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            const float* x0 = xs + m * K;
            const float* x1 = x0 + K;
            __m256 a[4], c[4];
            for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                if (m == 0 && pf) prefetch_lines(pf, k * 8, 2);
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
                store(y, m * N + n0 + j, hsum(a[j]), out_bf16);
                store(y, (m + 1) * N + n0 + j, hsum(c[j]), out_bf16);
            }
        }
        for (; m < M; m++) {
            const float* xm = xs + m * K;
            __m256 a[4], c[4];
            for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                if (m == 0 && pf) prefetch_lines(pf, k * 8, 2);
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
                store(y, m * N + n0 + j, hsum(_mm256_add_ps(a[j], c[j])), out_bf16);
        }
    }
    free(xs);
}


/* GEMM for more rows: y[M, N] = x[M, K] (fp32) @ W[N, K].T, W bf16 or fp32. A thread converts
   16 rows of W at a time into an fp32 panel laid out [K][16] (an 8x8 register transpose), then
   runs a 6x16 outer-product micro-kernel (12 accumulators: 6 broadcast rows of x times two
   8-wide panel vectors) over x in chunks of MC rows. W is read once per chunk, so torch's slow
   bf16 path (no native bf16 on AVX2) is never used and fp32 weights need no 2x copy. */
#define MC 192

static inline void load8_rows(const uint16_t* w, int64_t K, int64_t k, int nrows, __m256* r) {
    for (int i = 0; i < 8; i++)
        r[i] = i < nrows ? load_bf16(w + i * K + k) : _mm256_setzero_ps();
}
static inline void load8_rows_f32(const float* w, int64_t K, int64_t k, int nrows, __m256* r) {
    for (int i = 0; i < 8; i++)
        r[i] = i < nrows ? _mm256_loadu_ps(w + i * K + k) : _mm256_setzero_ps();
}

static inline void transpose8_store(__m256* r, float* dst) { /* dst[j * 16 + i] = r[i][j] */
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* panel[k * 16 + i] = W[n0 + i, k] as fp32 (0 for rows past N); K % 8 == 0. */
static void pack_panel(const void* w, int is_bf16, int64_t n0, int64_t N, int64_t K,
                       float* panel) {
    __m256 r[8];
    for (int half = 0; half < 2; half++) {
        int64_t first = n0 + half * 8;
        int nrows = N - first >= 8 ? 8 : (N - first > 0 ? (int)(N - first) : 0);
        for (int64_t k = 0; k < K; k += 8) {
            if (is_bf16)
                load8_rows((const uint16_t*)w + first * K, K, k, nrows, r);
            else
                load8_rows_f32((const float*)w + first * K, K, k, nrows, r);
            transpose8_store(r, panel + k * 16 + half * 8);
        }
    }
}

/* acc[6][16] = x[0..5, :] @ panel; rows past mr read row 0 (their results are dropped). */
static inline void micro_6x16(const float* x, int64_t ldx, int mr, const float* panel,
                              int64_t K, float* out /* [6][16] */, const char* pf,
                              int64_t pf_lines) {
    const float* xr[6];
    for (int i = 0; i < 6; i++) xr[i] = x + (i < mr ? i : 0) * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        if (k < pf_lines) _mm_prefetch(pf + 64 * k, _MM_HINT_T0);
        __m256 p0 = _mm256_loadu_ps(panel + k * 16), p1 = _mm256_loadu_ps(panel + k * 16 + 8);
        __m256 a;
        a = _mm256_broadcast_ss(xr[0] + k);
        c00 = _mm256_fmadd_ps(a, p0, c00); c01 = _mm256_fmadd_ps(a, p1, c01);
        a = _mm256_broadcast_ss(xr[1] + k);
        c10 = _mm256_fmadd_ps(a, p0, c10); c11 = _mm256_fmadd_ps(a, p1, c11);
        a = _mm256_broadcast_ss(xr[2] + k);
        c20 = _mm256_fmadd_ps(a, p0, c20); c21 = _mm256_fmadd_ps(a, p1, c21);
        a = _mm256_broadcast_ss(xr[3] + k);
        c30 = _mm256_fmadd_ps(a, p0, c30); c31 = _mm256_fmadd_ps(a, p1, c31);
        a = _mm256_broadcast_ss(xr[4] + k);
        c40 = _mm256_fmadd_ps(a, p0, c40); c41 = _mm256_fmadd_ps(a, p1, c41);
        a = _mm256_broadcast_ss(xr[5] + k);
        c50 = _mm256_fmadd_ps(a, p0, c50); c51 = _mm256_fmadd_ps(a, p1, c51);
    }
    _mm256_storeu_ps(out + 0, c00); _mm256_storeu_ps(out + 8, c01);
    _mm256_storeu_ps(out + 16, c10); _mm256_storeu_ps(out + 24, c11);
    _mm256_storeu_ps(out + 32, c20); _mm256_storeu_ps(out + 40, c21);
    _mm256_storeu_ps(out + 48, c30); _mm256_storeu_ps(out + 56, c31);
    _mm256_storeu_ps(out + 64, c40); _mm256_storeu_ps(out + 72, c41);
    _mm256_storeu_ps(out + 80, c50); _mm256_storeu_ps(out + 88, c51);
}

void gemm(const float* x, const void* w, int is_bf16, void* y, int64_t M, int64_t N, int64_t K,
          int out_bf16) {
    int64_t panels = (N + 15) / 16;
    #pragma omp parallel
    {
        float* panel = (float*)aligned_alloc(64, sizeof(float) * 16 * K);
        float tile[96];
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            int64_t mc = M - m0 < MC ? M - m0 : MC;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                int64_t n0 = p * 16;
                int cols = N - n0 < 16 ? (int)(N - n0) : 16;
                pack_panel(w, is_bf16, n0, N, K, panel);
                /* The next panel's weights stream in during this panel's first micro-kernel
                   (decode-sized M has only a few, so memory and FMAs would otherwise take
                   turns). */
                int64_t row_bytes = K * (is_bf16 ? 2 : 4);
                const char* pf = (const char*)w + (n0 + 16) * row_bytes;
                int64_t pf_lines = n0 + 16 < N ? ((N - n0 - 16 < 16 ? N - n0 - 16 : 16) *
                                                  row_bytes + 63) / 64 : 0;
                for (int64_t m = m0; m < m0 + mc; m += 6) {
                    int mr = m0 + mc - m < 6 ? (int)(m0 + mc - m) : 6;
                    micro_6x16(x + m * K, K, mr, panel, K, tile, pf, m == m0 ? pf_lines : 0);
                    for (int i = 0; i < mr; i++)
                        for (int j = 0; j < cols; j++)
                            store(y, (m + i) * N + n0 + j, tile[i * 16 + j], out_bf16);
                }
            }
        }
        free(panel);
    }
}

/* expf on 8 lanes (Cephes' polynomial after n*ln2 range reduction; ~1 ulp) for x <= 88. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* Four horizontal sums at once: [sum(a), sum(b), sum(c), sum(d)]. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Turn raw scores s[0..n) into exp(s - max) in place, zero s[n..n4); *mx = max; returns
   the sum. */
static float softmax_partial(float* s, int64_t n, int64_t n4, float* mx_out) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 m8 = _mm256_set1_ps(mx), tot8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
        _mm256_storeu_ps(s + i, e);
        tot8 = _mm256_add_ps(tot8, e);
    }
    float total = hsum(tot8);
    for (; i < n; i++) { s[i] = expf(s[i] - mx); total += s[i]; }
    for (; i < n4; i++) s[i] = 0.f;
    *mx_out = mx;
    return total;
}

/* Decode attention: q [B, Hq, D] fp32; k/v pool [S, Hkv, D]; slots [B, kmax]; lens [B];
   out [B, Hq, D] fp32. Query head h reads KV head h / (Hq / Hkv); D % 8 == 0.
   A slot's K (or V) for all heads is one contiguous row, and a page's slots are adjacent, so a
   task takes a request's keys in a chunk of up to 128 with all heads at once: memory is read
   front to back (reading one head's 256-byte piece of every row instead ran at half the
   bandwidth). Requests are split into chunks so that small batches still feed every thread;
   each chunk leaves its softmax max, sum and unnormalised output, merged per request at the end
   (the split-K "flash decoding" merge). Scores: four keys at a time, two query heads per pass
   (one combined horizontal sum). Values: four keys at a time into the chunk's [Hq, D]
   accumulator, which stays in L1. Rows PF_KEYS keys ahead are prefetched by hand. */
#define PF_KEYS 8
static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T0);
}

/* In a chunk function: the pool rows of keys i..i+3 (past n: key i's, which the caller weighs
   0) and of the keys PF_KEYS later (0 past n); then head hk's piece of the latter prefetched,
   one head at a time (a burst of whole rows would stall on full miss queues). */
#define FOUR_ROWS(POOL, ROWS, AHEAD)                                                          \
    for (int j = 0; j < 4; j++) {                                                           \
        ROWS[j] = POOL + sl[i + j < n ? i + j : i] * row;                                   \
        AHEAD[j] = i + PF_KEYS + j < n ? POOL + sl[i + PF_KEYS + j] * row : 0;              \
    }
#define PREFETCH_HEAD(AHEAD, hk)                                                              \
    for (int j = 0; j < 4; j++)                                                             \
        if (AHEAD[j]) prefetch_row(AHEAD[j] + (hk) * D, D * (int64_t)sizeof(*AHEAD[j]))

#define ATTN(NAME, KT, LOAD)                                                                  \
static void NAME##_chunk(const float* qb, const KT* kp, const KT* vp, const int64_t* sl,     \
                         int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale,        \
                         float* sc, float* po) {                                            \
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;                    \
    float* pm = po + Hq * D;                                                                \
    float* pl = pm + Hq;                                                                    \
    __m128 s4 = _mm_set1_ps(scale);                                                         \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *kr[4], *ahead[4];                                                         \
        FOUR_ROWS(kp, kr, ahead);                                                          \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, hk);                                                       \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0, hb = g0 + 1 < group ? ha + 1 : ha;            \
                const float* qa = qb + ha * D;                                              \
                const float* qw = qb + hb * D;                                              \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                  \
                for (int64_t d = 0; d < D; d += 8) {                                        \
                    int64_t o = hk * D + d;                                                 \
                    __m256 x = _mm256_loadu_ps(qa + d), y = _mm256_loadu_ps(qw + d);        \
                    __m256 k0 = LOAD(kr[0] + o), k1 = LOAD(kr[1] + o);                      \
                    __m256 k2 = LOAD(kr[2] + o), k3 = LOAD(kr[3] + o);                      \
                    a0 = _mm256_fmadd_ps(k0, x, a0); b0 = _mm256_fmadd_ps(k0, y, b0);       \
                    a1 = _mm256_fmadd_ps(k1, x, a1); b1 = _mm256_fmadd_ps(k1, y, b1);       \
                    a2 = _mm256_fmadd_ps(k2, x, a2); b2 = _mm256_fmadd_ps(k2, y, b2);       \
                    a3 = _mm256_fmadd_ps(k3, x, a3); b3 = _mm256_fmadd_ps(k3, y, b3);       \
                }                                                                           \
                _mm_storeu_ps(sc + hb * n4 + i, _mm_mul_ps(hsum4(b0, b1, b2, b3), s4));     \
                _mm_storeu_ps(sc + ha * n4 + i, _mm_mul_ps(hsum4(a0, a1, a2, a3), s4));     \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int64_t h = 0; h < Hq; h++) pl[h] = softmax_partial(sc + h * n4, n, n4, pm + h);   \
    for (int64_t e = 0; e < Hq * D; e += 8) _mm256_storeu_ps(po + e, _mm256_setzero_ps());  \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *vr[4], *ahead[4];                                                         \
        FOUR_ROWS(vp, vr, ahead);                                                          \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, hk);                                                       \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0;                                               \
                int two = g0 + 1 < group;                                                   \
                const float* pa = sc + ha * n4 + i;                                         \
                const float* pb = two ? pa + n4 : pa; /* padded keys weigh 0 */             \
                __m256 wa0 = _mm256_set1_ps(pa[0]), wa1 = _mm256_set1_ps(pa[1]);            \
                __m256 wa2 = _mm256_set1_ps(pa[2]), wa3 = _mm256_set1_ps(pa[3]);            \
                __m256 wb0 = _mm256_set1_ps(pb[0]), wb1 = _mm256_set1_ps(pb[1]);            \
                __m256 wb2 = _mm256_set1_ps(pb[2]), wb3 = _mm256_set1_ps(pb[3]);            \
                float* oa = po + ha * D;                                                    \
                float* ob = two ? oa + D : 0;                                               \
                for (int64_t d = 0; d < D; d += 8) {                                        \
                    int64_t o = hk * D + d;                                                 \
                    __m256 v0 = LOAD(vr[0] + o), v1 = LOAD(vr[1] + o);                      \
                    __m256 v2 = LOAD(vr[2] + o), v3 = LOAD(vr[3] + o);                      \
                    __m256 x = _mm256_loadu_ps(oa + d);                                     \
                    x = _mm256_fmadd_ps(wa0, v0, x); x = _mm256_fmadd_ps(wa1, v1, x);       \
                    x = _mm256_fmadd_ps(wa2, v2, x); x = _mm256_fmadd_ps(wa3, v3, x);       \
                    _mm256_storeu_ps(oa + d, x);                                            \
                    if (ob) {                                                               \
                        __m256 y = _mm256_loadu_ps(ob + d);                                 \
                        y = _mm256_fmadd_ps(wb0, v0, y); y = _mm256_fmadd_ps(wb1, v1, y);   \
                        y = _mm256_fmadd_ps(wb2, v2, y); y = _mm256_fmadd_ps(wb3, v3, y);   \
                        _mm256_storeu_ps(ob + d, y);                                        \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
void NAME(const float* q, const KT* kp, const KT* vp, const int64_t* slots,                  \
          const int64_t* lens, int64_t kmax, float* out, int64_t B, int64_t Hq,             \
          int64_t Hkv, int64_t D, float scale) {                                            \
    int64_t chunk, T, *first, *owner;                                                       \
    float* part = plan_chunks(lens, B, Hq, D, &chunk, &T, &first, &owner);                  \
    int64_t stride = Hq * (D + 2);                                                          \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
        float* sc = (float*)malloc(sizeof(float) * Hq * chunk);                             \
        _Pragma("omp for schedule(dynamic)")                                                \
        for (int64_t t = 0; t < T; t++) {                                                   \
            int64_t b = owner[t], c0 = (t - first[b]) * chunk;                              \
            int64_t n = lens[b] - c0 < chunk ? lens[b] - c0 : chunk;                        \
            NAME##_chunk(q + b * Hq * D, kp, vp, slots + b * kmax + c0, n, Hq, Hkv, D,      \
                         scale, sc, part + t * stride);                                     \
        }                                                                                   \
        free(sc);                                                                           \
        merge_chunks(part, first, B, Hq, D, out);                                           \
    }                                                                                       \
    free(part); free(first); free(owner);                                                   \
}

/* Chunk length (a multiple of 4, 16..128: enough tasks for every thread, few merges), the
   chunks' first index per request, each chunk's request, and the chunks' partial results. */
static float* plan_chunks(const int64_t* lens, int64_t B, int64_t Hq, int64_t D,
                          int64_t* chunk, int64_t* T, int64_t** first, int64_t** owner) {
    int64_t total = 0, threads = omp_get_max_threads();
    for (int64_t b = 0; b < B; b++) total += lens[b];
    int64_t c = (total + 4 * threads - 1) / (4 * threads);
    c = c < 16 ? 16 : (c > 128 ? 128 : c);
    *chunk = c = (c + 3) & ~(int64_t)3;
    *first = (int64_t*)malloc(sizeof(int64_t) * (B + 1));
    (*first)[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lens[b] > 0 ? lens[b] : 1;
        (*first)[b + 1] = (*first)[b] + (n + c - 1) / c;
    }
    *T = (*first)[B];
    *owner = (int64_t*)malloc(sizeof(int64_t) * *T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = (*first)[b]; t < (*first)[b + 1]; t++) (*owner)[t] = b;
    return (float*)malloc(sizeof(float) * *T * Hq * (D + 2));
}

/* Per request and head: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c (inside a parallel
   region: the requests are shared among its threads). */
static void merge_chunks(const float* part, const int64_t* first, int64_t B, int64_t Hq,
                         int64_t D, float* out) {
    int64_t stride = Hq * (D + 2);
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hq; h++) {
            float mx = -INFINITY, total = 0.f;
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                float m = part[t * stride + Hq * D + h];
                mx = m > mx ? m : mx;
            }
            float* o = out + (b * Hq + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                const float* p = part + t * stride;
                float w = expf(p[Hq * D + h] - mx);
                total += w * p[Hq * D + Hq + h];
                for (int64_t d = 0; d < D; d++) o[d] += w * p[h * D + d];
            }
            float inv = 1.f / total;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

ATTN(decode_attn_bf16, uint16_t, load_bf16)
ATTN(decode_attn_f32, float, load_f32)

static inline float bf16_to_f32(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float v) {
    uint32_t b;
    __builtin_memcpy(&b, &v, 4);
    b += 0x7FFF + ((b >> 16) & 1);
    return (uint16_t)(b >> 16);
}
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline float id_f32(float v) { return v; }

/* RMSNorm over rows of D (row i of x: token i / x_group at x_stride apart, head i % x_group),
   weight row (i % w_rows), with an optional residual add first (res_out = x + res_in,
   normalising that) and an optional rotary embedding after (cos and the signed sin of the
   row's token, [tokens, D]: out = y * cos + roll(y, D / 2) * sin, as rotary.apply_rotary).
   Rounds where torch's eager ops in the model dtype round, so results match the PyTorch path
   (up to the order of the sum of squares). */
#define RMSNORM(NAME, T, TO_F, ROUND, FROM_F)                                                 \
void NAME(const T* x, int64_t x_group, int64_t x_stride, const T* res_in, T* res_out,       \
          const T* w,                                                                       \
          int64_t w_rows, T* out, int64_t M, int64_t D, float eps, const T* cos,            \
          const T* sin) {                                                                   \
    _Pragma("omp parallel for schedule(static) if (M * D > 65536)")                         \
    for (int64_t i = 0; i < M; i++) {                                                       \
        const T* xr = x + (i / x_group) * x_stride + (i % x_group) * D;                     \
        const T* wr = w + (i % w_rows) * D;                                                 \
        T* o = out + i * D;                                                                 \
        float ss = 0.f;                                                                     \
        if (res_in) {                                                                       \
            for (int64_t d = 0; d < D; d++) {                                               \
                float v = ROUND(TO_F(xr[d]) + TO_F(res_in[i * D + d]));                     \
                res_out[i * D + d] = FROM_F(v);                                             \
                ss += v * v;                                                                \
            }                                                                               \
            xr = res_out + i * D;                                                           \
        } else {                                                                            \
            for (int64_t d = 0; d < D; d++) { float v = TO_F(xr[d]); ss += v * v; }         \
        }                                                                                   \
        float inv = 1.f / sqrtf(ss / (float)D + eps);                                       \
        if (!cos) {                                                                         \
            for (int64_t d = 0; d < D; d++)                                                 \
                o[d] = FROM_F(ROUND(TO_F(wr[d]) * ROUND(TO_F(xr[d]) * inv)));               \
            continue;                                                                       \
        }                                                                                   \
        float y[512]; /* D <= 512, checked by the caller */                                 \
        for (int64_t d = 0; d < D; d++)                                                     \
            y[d] = ROUND(TO_F(wr[d]) * ROUND(TO_F(xr[d]) * inv));                           \
        const T* c = cos + (i / x_group) * D;                                               \
        const T* sn = sin + (i / x_group) * D;                                              \
        for (int64_t d = 0, h = D / 2; d < D; d++)                                          \
            o[d] = FROM_F(ROUND(ROUND(y[d] * TO_F(c[d])) +                                  \
                                ROUND(y[d < h ? d + h : d - h] * TO_F(sn[d]))));            \
    }                                                                                       \
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] (a row is gate then up), rounded where torch's
   F.silu(gate) * up rounds in the model dtype; one pass instead of three, on 8 lanes. */
static inline __m256 silu8(__m256 a) {
    __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), _mm256_set1_ps(88.f)));
    return _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
static inline __m256 round8_bf16(__m256 v) { /* to the nearest bf16, ties to even */
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void store8_bf16(uint16_t* p, __m256 rounded) {
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

void silu_mul_f32(const float* x, float* out, int64_t M, int64_t I) {
    #pragma omp parallel for schedule(static) if (M * I > 65536)
    for (int64_t t = 0; t < M; t++) {
        const float* g = x + t * 2 * I;
        const float* u = g + I;
        float* o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void silu_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I) {
    #pragma omp parallel for schedule(static) if (M * I > 65536)
    for (int64_t t = 0; t < M; t++) {
        const uint16_t* g = x + t * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 sg = round8_bf16(silu8(load_bf16(g + i)));
            store8_bf16(o + i, round8_bf16(_mm256_mul_ps(sg, load_bf16(u + i))));
        }
        for (; i < I; i++) {
            float a = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(a / (1.f + expf(-a))) * bf16_to_f32(u[i]));
        }
    }
}

RMSNORM(rmsnorm_bf16, uint16_t, bf16_to_f32, round_bf16, f32_to_bf16)
RMSNORM(rmsnorm_f32, float, id_f32, id_f32, id_f32)
"""


def _enabled() -> bool:
    if os.environ.get("MINISGL_CPU_KERNELS", "1") in ("0", "false", "no"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cache_dir() -> Path:
    root = os.environ.get("MINISGL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minisgl"
    )
    return Path(root) / "kernels"


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256((_SOURCE + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu-kernels-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "gemv.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / "gemv.so"
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(src), "-o"]
        result = subprocess.run(cmd + [str(lib), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            logger.info("CPU gemv kernel not built (%s): %s", cc, result.stderr[-500:])
            return None
        os.replace(lib, out)  # atomic: concurrent builders (TP ranks) agree on one file
    return out


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        args: list[Any] = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        for fn in (lib.gemv_bf16, lib.gemv_f32):
            fn.argtypes = args
            fn.restype = None
        self.bf16, self.f32 = lib.gemv_bf16, lib.gemv_f32
        attn_args: list[Any] = [ptr] * 5 + [i64, ptr, i64, i64, i64, i64, ctypes.c_float]
        for fn in (lib.decode_attn_bf16, lib.decode_attn_f32):
            fn.argtypes = attn_args
            fn.restype = None
        self.attn_bf16, self.attn_f32 = lib.decode_attn_bf16, lib.decode_attn_f32
        lib.gemm.argtypes = [ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int]
        lib.gemm.restype = None
        self.gemm = lib.gemm
        norm_args: list[Any] = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ctypes.c_float]
        for fn in (lib.rmsnorm_bf16, lib.rmsnorm_f32):
            fn.argtypes = norm_args + [ptr, ptr]
            fn.restype = None
        self.norm_bf16, self.norm_f32 = lib.rmsnorm_bf16, lib.rmsnorm_f32
        for fn in (lib.silu_mul_bf16, lib.silu_mul_f32):
            fn.argtypes = [ptr, ptr, i64, i64]
            fn.restype = None
        self.silu_mul_bf16, self.silu_mul_f32 = lib.silu_mul_bf16, lib.silu_mul_f32


_LIB: _Lib | None = None
_TRIED = False


def load() -> _Lib | None:
    """The compiled kernel, or None where it cannot be used here."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            path = _build() if _enabled() else None
            _LIB = _Lib(path) if path is not None else None
        except OSError as e:
            logger.info("CPU gemv kernel unavailable: %s", e)
            _LIB = None
    return _LIB


def supports(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.dim() == 2
        and weight.shape[1] % (16 if weight.dtype == torch.bfloat16 else 8) == 0
        and weight.is_contiguous()
        and load() is not None
    )


def _matmul_operands(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.dtype]:
    """The loaded library, x as contiguous fp32, and the output buffer [M, N]."""
    lib = load()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    xf = x.contiguous().float()
    return lib, xf, torch.empty(xf.shape[0], weight.shape[0], dtype=out_dtype), out_dtype


def gemv(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight.T -> [M, N] in `out_dtype` (default x's dtype)."""
    lib, xf, y, out_dtype = _matmul_operands(x, weight, out_dtype)
    m, k = xf.shape
    n = weight.shape[0]
    fn = lib.bf16 if weight.dtype == torch.bfloat16 else lib.f32
    fn(xf.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, int(out_dtype == torch.bfloat16))
    return y


def gemm(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype), any M; weight as for
    `supports` (K % 16 for bf16, K % 8 for fp32). Computed in fp32 from bf16 or fp32 weights."""
    lib, xf, y, out_dtype = _matmul_operands(x, weight, out_dtype)
    m, k = xf.shape
    n = weight.shape[0]
    lib.gemm(
        xf.data_ptr(),
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        y.data_ptr(),
        m,
        n,
        k,
        int(out_dtype == torch.bfloat16),
    )
    return y


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per request: q [B, Hq, D] over the pool rows `slots` [B, kmax] (int64, the
    first lens[b] valid) of k/v_pool [S, Hkv, D] -> [B, Hq * D] in q's dtype."""
    lib = load()
    assert lib is not None
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    qf = q.contiguous().float()
    out = torch.empty(b, hq, d, dtype=torch.float32)
    fn = lib.attn_bf16 if k_pool.dtype == torch.bfloat16 else lib.attn_f32
    fn(
        qf.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        slots.shape[1],
        out.data_ptr(),
        b,
        hq,
        hkv,
        d,
        scale,
    )
    return out.view(b, hq * d).to(q.dtype)


def supports_decode_attention(pool: torch.Tensor, num_heads: int = 1) -> bool:
    """`num_heads` query heads over this pool [S, Hkv, D] (the kernel takes up to 64 query heads
    per KV head)."""
    return (
        pool.device.type == "cpu"
        and num_heads // max(pool.shape[1], 1) <= 64
        and pool.dtype in (torch.bfloat16, torch.float32)
        and pool.shape[-1] % 8 == 0
        and pool.is_contiguous()
        and load() is not None
    )


def rms_norm_supported(x: torch.Tensor) -> bool:
    """x [M, ..., D] with unit stride in the last dim and rows a fixed stride apart."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.stride(-1) == 1
        and load() is not None
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight * normalise(x [+ residual]) over the last dim; `weight` is [D] or [H, D] (per
    head: x is [T, H, D]). `rope`: (cos, signed sin) per token, [T, 1, D] in x's dtype, applied
    after (as rotary.apply_rotary; D <= 512). Returns (out, x + residual or None) as new
    contiguous tensors."""
    lib = load()
    assert lib is not None
    d = x.shape[-1]
    rows = x.numel() // d
    # Rows: [T, D] at any token stride, or [T, H, D] with each token's H heads packed.
    if x.dim() == 3 and x.stride(1) != d:
        x = x.contiguous()
    group = x.shape[1] if x.dim() == 3 else 1
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    res_in = residual.contiguous() if residual is not None else None
    fn = lib.norm_bf16 if x.dtype == torch.bfloat16 else lib.norm_f32
    cos, sin = (t.contiguous() for t in rope) if rope is not None else (None, None)
    fn(
        x.data_ptr(),
        group,
        x.stride(0),
        res_in.data_ptr() if res_in is not None else None,
        res_out.data_ptr() if res_out is not None else None,
        w.data_ptr(),
        w.numel() // d,
        out.data_ptr(),
        rows,
        d,
        eps,
        cos.data_ptr() if cos is not None else None,
        sin.data_ptr() if sin is not None else None,
    )
    return out, res_out


def silu_mul_supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.dim() == 2
        and x.shape[1] % 2 == 0
        and x.is_contiguous()
        and load() is not None
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I], in x's dtype."""
    lib = load()
    assert lib is not None
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, i, dtype=x.dtype)
    fn = lib.silu_mul_bf16 if x.dtype == torch.bfloat16 else lib.silu_mul_f32
    fn(x.data_ptr(), out.data_ptr(), t, i)
    return out
