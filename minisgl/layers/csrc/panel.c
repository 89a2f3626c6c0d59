/* Matmul on bf16 weights repacked into 16-column panels: y[M, N] = x[M, K] @ W[N, K].T.

   Panel q holds W's rows 16q..16q+15 as [K][16] bf16, so a thread streams one contiguous run of
   memory (the row-major GEMV reads four short row streams per block, which the hardware
   prefetcher barely learns), and one 32-byte load gives the 16 outputs' weights for one k:
   lane 2j holds column j, lane 2j+1 column 8+j, so a shift and a mask make the two fp32
   halves without a shuffle. Rows of x are broadcast against them in register tiles of up to 6
   rows x 16 columns (12 accumulators, each one FMA per k: never waiting on the FMA latency).

   K is walked in chunks of KC so that a chunk of the panel (8 KB) and of the input rows stay in
   L1 while every row tile passes over it; the accumulators wait in a small buffer between
   chunks. During the first tile of a chunk the lines ahead of the read are prefetched into L1
   (memory keeps streaming while the FMAs run: measured on a 2-core Zen 3, 8 rows from memory
   10-25% faster than the row-major GEMV, one row 3-15%): for the passes of up to 16 rows
   panel_pf_near bytes ahead, or where the running machine measured that faster
   (panel_few_rows_far) the chunk PF_CHUNKS ahead, as the passes of more rows. On a later
   2-core Zen 3 (the 0.6B decode step's 113 matmuls, 2 threads, cold panels, in turns) 1-2 KB
   ahead read 1.07-1.11x faster than 16 KB at one row, 1.03-1.06x at 2-4 rows, up to 1.07x at
   8 (lines 16 KB ahead leave L1 before their k comes: L1 holds 32 KB; 16 KB ran no faster
   than no prefetch at all, 1 KB 1.08-1.14x faster than none at one row). K % 16 == 0.

   The AVX-512 build compiles panel512.c instead: the same entry points on 32-column panels
   with K in pairs (VDPBF16PS's layout; 16-lane FMAs where the CPU lacks AVX512-BF16). */
#include "common.h"
#include "panel.h"

#ifndef __AVX512F__

/* The panels' layout, for the Python side (cpu_kernels.panel_rows): 0 = [K][16], lanes as
   panel_pack_bf16 orders them. */
int panel_layout = 0;

#define KC 256
#define PF_CHUNKS 2
#define MB 96 /* input rows per pass over the weights: their accumulators fit on the stack */
/* How far ahead of the read the passes of up to 16 rows prefetch (bytes of the panel's run): a
   switch for the benchmarks. */
int64_t panel_pf_near = 2048;
/* 1: those passes prefetch PF_CHUNKS chunks ahead, as more rows do. Set at start-up by the
   faster on the running machine (cpu_kernels.measure_panel_few_rows_far). */
int panel_few_rows_far = 0;

void panel_pack_bf16(const uint16_t* w, uint16_t* p, int64_t N, int64_t K) {
    int64_t panels = (N + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels; q++) {
        uint16_t* out = p + q * K * 16;
        for (int c = 0; c < 16; c++) {
            int64_t n = q * 16 + c;
            const int64_t lane = panel16_lane(c);
            for (int64_t k = 0; k < K; k++) out[k * 16 + lane] = n < N ? w[n * K + k] : 0;
        }
    }
}

#define WEIGHTS(k)                                                                        \
    __m256i v = _mm256_loadu_si256((const __m256i*)(pw + (k) * 16));                      \
    __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                            \
    __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
/* One line of the chunk ahead per two k (a k step reads 32 bytes). */
#define PREFETCH(k) \
    if (pf && ((k) & 1) == 0) _mm_prefetch(pf + (k) * 32, _MM_HINT_T0);

/* A chunk already converted to fp32 ([kc][16]): two loads, no conversion. */
#define WEIGHTS_F32(k)                                                                    \
    __m256 we = _mm256_loadu_ps(pw + (k) * 16), wo = _mm256_loadu_ps(pw + (k) * 16 + 8);

/* R rows x 16 columns: acc[i * 16 + c] += x[i, k] * W[c, k] over the chunk, the weights of a
   k step made by LOAD (WEIGHTS from bf16 panels, WEIGHTS_F32 from a converted chunk). */
#define TILE(NAME, R, WT, LOAD)                                                             \
static inline void NAME(const float* x, int64_t ldx, int64_t kc, const WT* pw, float* acc,   \
                        const char* pf) {                                                   \
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);                                 \
    (void)hi;                                                                               \
    __m256 e[R], o[R];                                                                      \
    for (int i = 0; i < R; i++) {                                                           \
        e[i] = _mm256_loadu_ps(acc + 16 * i);                                               \
        o[i] = _mm256_loadu_ps(acc + 16 * i + 8);                                           \
    }                                                                                       \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; k++) {                             \
        PREFETCH(k)                                                                         \
        LOAD(k)                                                                             \
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {                               \
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                                \
            e[i] = _mm256_fmadd_ps(a, we, e[i]);                                            \
            o[i] = _mm256_fmadd_ps(a, wo, o[i]);                                            \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < R; i++) {                                                           \
        _mm256_storeu_ps(acc + 16 * i, e[i]);                                               \
        _mm256_storeu_ps(acc + 16 * i + 8, o[i]);                                           \
    }                                                                                       \
}
TILE(tile6, 6, uint16_t, WEIGHTS)
TILE(tile5, 5, uint16_t, WEIGHTS)
TILE(tile4, 4, uint16_t, WEIGHTS)
TILE(tile3, 3, uint16_t, WEIGHTS)
TILE(tile6_f32, 6, float, WEIGHTS_F32)
TILE(tile5_f32, 5, float, WEIGHTS_F32)
TILE(tile4_f32, 4, float, WEIGHTS_F32)
TILE(tile3_f32, 3, float, WEIGHTS_F32)
TILE(tile2_f32, 2, float, WEIGHTS_F32)
TILE(tile1_f32, 1, float, WEIGHTS_F32)

/* Chunk kc of a panel to fp32 [kc][16] (columns in order), prefetching `pf` as it goes. */
static inline void convert_chunk(const uint16_t* pw, int64_t kc, float* out, const char* pf) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < kc; k++) {
        PREFETCH(k)
        WEIGHTS(k)
        _mm256_storeu_ps(out + k * 16, we);
        _mm256_storeu_ps(out + k * 16 + 8, wo);
    }
}

/* Two rows: k in pairs on separate accumulators (four would wait on the FMA latency). */
static inline void tile2(const float* x, int64_t ldx, int64_t kc, const uint16_t* pw,
                         float* acc, const char* pf) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 e[2][2], o[2][2];
    for (int i = 0; i < 2; i++) {
        e[0][i] = _mm256_loadu_ps(acc + 16 * i);
        o[0][i] = _mm256_loadu_ps(acc + 16 * i + 8);
        e[1][i] = o[1][i] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k += 2) {
        PREFETCH(k)
        for (int s = 0; s < 2; s++) {
            WEIGHTS(k + s)
            for (int i = 0; i < 2; i++) {
                __m256 a = _mm256_broadcast_ss(x + i * ldx + k + s);
                e[s][i] = _mm256_fmadd_ps(a, we, e[s][i]);
                o[s][i] = _mm256_fmadd_ps(a, wo, o[s][i]);
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        _mm256_storeu_ps(acc + 16 * i, _mm256_add_ps(e[0][i], e[1][i]));
        _mm256_storeu_ps(acc + 16 * i + 8, _mm256_add_ps(o[0][i], o[1][i]));
    }
}

/* One row: k in fours on separate accumulators. */
static inline void tile1(const float* x, int64_t ldx, int64_t kc, const uint16_t* pw,
                         float* acc, const char* pf) {
    (void)ldx;
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 e[4], o[4];
    e[0] = _mm256_loadu_ps(acc);
    o[0] = _mm256_loadu_ps(acc + 8);
    for (int s = 1; s < 4; s++) e[s] = o[s] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k += 4) {
        if (pf) {
            _mm_prefetch(pf + k * 32, _MM_HINT_T0);
            _mm_prefetch(pf + k * 32 + 64, _MM_HINT_T0);
        }
        for (int s = 0; s < 4; s++) {
            WEIGHTS(k + s)
            __m256 a = _mm256_broadcast_ss(x + k + s);
            e[s] = _mm256_fmadd_ps(a, we, e[s]);
            o[s] = _mm256_fmadd_ps(a, wo, o[s]);
        }
    }
    _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])));
    _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(o[0], o[1]), _mm256_add_ps(o[2], o[3])));
}

/* Rows of the next tile of a pass of up to 16 rows, for `left` rows still to do: 6 while they
   last, then the rest in one tile (3 rows ran as 2 + 1 and 5 as 4 + 1: a one-row tile reads the
   chunk again for one row's FMAs). Passes of more rows take tiles of near-equal sizes instead
   (32 rows: 6 + 6 + 5 + 5 + 5 + 5, not 6 x 5 + 2: a tile of fewer than 4 rows waits on the FMA
   latency with its few accumulators; on a 2-core Zen 3, cold 0.6B-shaped layers, over
   converted chunks 20 rows 1.07x faster, 32 rows 1.035x). */
static inline int tile_rows(int64_t left) { return left >= 6 ? 6 : (int)left; }

/* x rows m0..m0+mb against panel `pq` (all of K), into acc [mb][16]. `pf_end`: the first byte
   past the packed weights (no prefetch beyond). */
/* Few rows: the tiles convert as they go, so the FMAs overlap the chunk's arrival from memory
   instead of waiting for a conversion pass (measured on a 2-core Zen 3, 4096x1024: converting
   first 25% slower at 8 rows). Many rows (prefill's passes of up to MB): each chunk is
   converted to fp32 once and every tile reads that (no shift and mask per tile: 25% faster at
   64 and 256 rows on that Zen 3). In between (17-64 rows, a decode batch), where the running
   machine measured it faster, as many rows, else as few (on a later 2-core Zen 3, cold
   0.6B-shaped layers, in turns: the tiles converting 1.06-1.12x faster at 32 rows, 1.22x at
   20; at 48 and 96 rows converting first 1.09-1.13x faster, as the conversion's stores and
   reloads spread over more rows). */
/* 1: passes of 17-64 rows convert each chunk first. Set at start-up by the faster on the
   running machine (cpu_kernels.measure_panel_convert_first). */
int panel_convert_first = 1;
#define CONVERT(mb) ((mb) > 64 || ((mb) > 16 && panel_convert_first))
static void panel_rows(const float* x, int64_t K, int64_t mb, const uint16_t* pq, float* acc,
                       const char* pf_end) {
    float wf[KC * 16] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        const uint16_t* pw = pq + k0 * 16;
        const char* pf = mb > 16 || panel_few_rows_far ? (const char*)(pw + PF_CHUNKS * KC * 16)
                                                       : (const char*)pw + panel_pf_near;
        if (pf + kc * 32 > pf_end) pf = 0;
        if (CONVERT(mb)) convert_chunk(pw, kc, wf, pf);
        /* more than 16 rows: tiles of near-equal sizes (tile_rows) */
        int64_t tiles = (mb + 5) / 6, base = mb / tiles, extra = mb % tiles, t = 0;
        for (int64_t m = 0, r; m < mb; m += r, t++) {
            r = mb > 16 ? (int64_t)base + (t < extra) : tile_rows(mb - m);
            const float* xm = x + m * K + k0;
            float* am = acc + m * 16;
            if (CONVERT(mb)) {
                switch (r) {
                    case 6: tile6_f32(xm, K, kc, wf, am, 0); break;
                    case 5: tile5_f32(xm, K, kc, wf, am, 0); break;
                    case 4: tile4_f32(xm, K, kc, wf, am, 0); break;
                    case 3: tile3_f32(xm, K, kc, wf, am, 0); break;
                    case 2: tile2_f32(xm, K, kc, wf, am, 0); break;
                    default: tile1_f32(xm, K, kc, wf, am, 0);
                }
                continue;
            }
            const char* first = m == 0 ? pf : 0;
            switch (r) {
                case 6: tile6(xm, K, kc, pw, am, first); break;
                case 5: tile5(xm, K, kc, pw, am, first); break;
                case 4: tile4(xm, K, kc, pw, am, first); break;
                case 3: tile3(xm, K, kc, pw, am, first); break;
                case 2: tile2(xm, K, kc, pw, am, first); break;
                default: tile1(xm, K, kc, pw, am, first);
            }
        }
    }
}

/* y = x @ W.T from the packed panels `p` (panel_pack_bf16); x fp32, or bf16 where x_bf16. */
void panel_bf16(const void* x, const uint16_t* p, void* y, int64_t M, int64_t N, int64_t K,
                int out_bf16, int x_bf16) {
    const float* xf = (const float*)x;
    float* conv = 0;
    if (x_bf16) {
        conv = (float*)malloc(sizeof(float) * M * K);
        /* Split over the threads for a prefill chunk, as torch converts the GEMM's x: one
           thread converting 1024 x 3072 values held the other back. */
        #pragma omp parallel for schedule(static) if (M >= 64)
        for (int64_t r = 0; r < M; r++) {
            const uint16_t* src = (const uint16_t*)x + r * K;
            float* dst = conv + r * K;
            for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(dst + k, load_bf16(src + k));
        }
        xf = conv;
    }
    int64_t panels = (N + 15) / 16;
    const char* end = (const char*)(p + panels * K * 16);
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        int64_t mb = M - m0 < MB ? M - m0 : MB;
        shares_init(shares, parts, panels);
        #pragma omp parallel
        for (int64_t q; (q = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            float acc[MB * 16];
            for (int64_t i = 0; i < mb * 16; i++) acc[i] = 0.f;
            panel_rows(xf + m0 * K, K, mb, p + q * K * 16, acc, end);
            int64_t n0 = q * 16;
            int cols = N - n0 < 16 ? (int)(N - n0) : 16;
            for (int64_t i = 0; i < mb; i++) {
                if (cols == 16 && !out_bf16) {
                    float* out = (float*)y + (m0 + i) * N + n0;
                    _mm256_storeu_ps(out, _mm256_loadu_ps(acc + i * 16));
                    _mm256_storeu_ps(out + 8, _mm256_loadu_ps(acc + i * 16 + 8));
                } else {
                    for (int c = 0; c < cols; c++)
                        store(y, (m0 + i) * N + n0 + c, acc[i * 16 + c], out_bf16);
                }
            }
        }
    }
    free(conv);
}

#endif
