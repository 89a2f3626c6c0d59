#include "common.h"

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
