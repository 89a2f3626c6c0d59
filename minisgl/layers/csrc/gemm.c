#include "common.h"

/* GEMM for more rows: y[M, N] = x[M, K] (fp32) @ W[N, K].T, W bf16 or fp32. A thread converts
   16 rows of W at a time into an fp32 panel laid out [K][16] (an 8x8 register transpose), then
   runs a 6x16 outer-product micro-kernel (12 accumulators: 6 broadcast rows of x times two
   8-wide panel vectors; a chunk's last rows in tiles of 3 to 6 rows) over x in chunks of MC
   rows. W is read once per chunk, so torch's slow
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

/* out[R][16] = x[0..R-1, :] @ panel, the accumulators in registers (R <= 6: 2R of them).
   `pf_lines` lines from `pf` are prefetched, one per k. */
#define MICRO(NAME, R)                                                                     \
static inline void NAME(const float* x, int64_t ldx, const float* panel, int64_t K,        \
                        float* out, const char* pf, int64_t pf_lines) {                    \
    __m256 e[R], o[R];                                                                     \
    for (int i = 0; i < R; i++) e[i] = o[i] = _mm256_setzero_ps();                         \
    for (int64_t k = 0; k < K; k++) {                                                      \
        if (k < pf_lines) _mm_prefetch(pf + 64 * k, _MM_HINT_T0);                         \
        __m256 p0 = _mm256_loadu_ps(panel + k * 16), p1 = _mm256_loadu_ps(panel + k * 16 + 8); \
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {                              \
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                               \
            e[i] = _mm256_fmadd_ps(a, p0, e[i]);                                           \
            o[i] = _mm256_fmadd_ps(a, p1, o[i]);                                           \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < R; i++) {                                                          \
        _mm256_storeu_ps(out + 16 * i, e[i]);                                              \
        _mm256_storeu_ps(out + 16 * i + 8, o[i]);                                          \
    }                                                                                      \
}
MICRO(micro_6x16, 6)
MICRO(micro_5x16, 5)
MICRO(micro_4x16, 4)
MICRO(micro_3x16, 3)
MICRO(micro_2x16, 2)
MICRO(micro_1x16, 1)

/* Rows of a tile for `left` rows still to do: 6 while more than 8 are left, then the rest in
   tiles of 3 to 6 (a 6-row tile over fewer rows computed the missing ones and dropped them: a
   32-row decode batch ran 36 rows' FMAs; and 1 or 2 rows keep too few FMAs in flight to hide
   their latency, so 7 go as 4 + 3 and 8 as 4 + 4). */
static inline int tile_rows(int64_t left) {
    if (left > 8 || left == 6) return 6;
    if (left == 7 || left == 8) return 4;
    return (int)left;
}

static inline void micro(int r, const float* x, int64_t ldx, const float* panel, int64_t K,
                         float* out, const char* pf, int64_t pf_lines) {
    switch (r) {
        case 6: micro_6x16(x, ldx, panel, K, out, pf, pf_lines); break;
        case 5: micro_5x16(x, ldx, panel, K, out, pf, pf_lines); break;
        case 4: micro_4x16(x, ldx, panel, K, out, pf, pf_lines); break;
        case 3: micro_3x16(x, ldx, panel, K, out, pf, pf_lines); break;
        case 2: micro_2x16(x, ldx, panel, K, out, pf, pf_lines); break;
        default: micro_1x16(x, ldx, panel, K, out, pf, pf_lines);
    }
}

void gemm(const float* x, const void* w, int is_bf16, void* y, int64_t M, int64_t N, int64_t K,
          int out_bf16) {
    int64_t panels = (N + 15) / 16;
    #pragma omp parallel
    {
        float* panel = (float*)aligned_alloc(64, sizeof(float) * 16 * K);
        float tile[96];
        int mr;
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
                for (int64_t m = m0; m < m0 + mc; m += mr) {
                    mr = tile_rows(m0 + mc - m);
                    micro(mr, x + m * K, K, panel, K, tile, pf, m == m0 ? pf_lines : 0);
                    for (int i = 0; i < mr; i++)
                        for (int j = 0; j < cols; j++)
                            store(y, (m + i) * N + n0 + j, tile[i * 16 + j], out_bf16);
                }
            }
        }
        free(panel);
    }
}
