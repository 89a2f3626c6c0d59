/* Many rows (prefill, big decode batches) of x in 8 bits against integer codes (8-bit per
   channel, 4-bit in groups) with AVX512-VNNI: --cpu-quantized-activations int8 past the rows
   qgemv.c's x8v takes (minisgl/quant/cpu_panel.py's x8_panel).

   Why a kernel of its own: VPDPBUSD does 64 multiply-adds an instruction, VDPBF16PS (the bf16
   panel, qamx.c) 32, so integer codes against 8-bit x can beat a bf16 matmul on the same core.
   qgemv's x8v sums along K in each lane and folds a 4-bit group every 2 VPDPBUSD per pair of
   rows; here the sums run along the outputs instead ("output form"), and a fold comes once per
   block of features for 24 accumulators.

   Layout and blocking: each thread takes panels of QV_NP = 48 weight rows (3 zmm of 16
   outputs) and repacks the panel's codes once per call into VPDPBUSD's layout
   [K/4][48][4 bytes] (4-bit codes unpacked to bytes 0..15, 8-bit as they are; 48 * K bytes,
   within L2) with the panel's scales and zero points as [G][48] floats. x is quantized once
   per call, per row and block of B features (a 4-bit group of 32, 64 or 128; 128 features of
   a longer group or of 8-bit per channel), to int8 with its own scale (max|x| / 127, nearest
   even), plus the block's sum of codes for the zero points, and laid out per tile of QV_MR = 8
   rows as [K/4][8] dwords, so a step's broadcasts read one short run. A tile of 8 rows x 48
   outputs keeps 24 int32 accumulators in registers: per 4 features 3 weight loads and 24
   VPDPBUSD (codes the unsigned operand, x's 4 bytes broadcast the signed one). At each block's
   end the exact integer sums are folded into fp32 sums (L1 scratch) as
       y[m, n] += s_w[n, g] * s_x[m, b] * (sum_k q[n, k] x8[m, k] - z[n, g] * xsum8[m, b])
   (the subtraction exact in fp32: both sides < 2^24). Rows of a tile never mix: a row's result
   does not depend on the rows beside it or the thread count. Panels are shared among the
   threads as the other kernels do (common.h); with few panels and many rows, a panel's rows
   are split too.

   Numerics: relative error against the exact float matmul on the dequantized weight
   0.0045-0.0074 on random data (8-bit per channel, 4-bit groups of 128/64/32), as qgemv's
   x8v (0.005-0.007); equal to a torch emulation of the same rounding to fp32 rounding
   (tests/unit/test_quant_x8_panel.py).

   Measured (AMD EPYC Zen 4, avx512f/bw/vl, avx512_bf16, avx512_vnni, no AMX; 1 thread, CPU
   time, best of 5-7 interleaved, hot weights; Qwen3-0.6B shapes 2048x1024, 1024x2048,
   6144x1024, 1024x3072), time against oneDNN's bf16 matmul on the bf16 weight in the same
   run: 512 rows 0.57-0.61x for 8-bit codes, 0.56-0.60x for 4-bit (the bf16 panel, qamx.c:
   0.94-1.03x; qgemv's x8v on 64-row slices: 8-bit 0.69-0.98x, 4-bit 1.41-1.51x); 64 rows
   8-bit 0.50-0.59x, 4-bit 0.48-0.58x; 16 rows 8-bit 0.38-0.54x (x8v 0.38-0.59x), 4-bit
   0.37-0.58x (x8v 0.70-1.00x). 2 threads, wall, 512 rows: 0.57-0.62x. Hence the untuned
   picks (quant/cpu_choice.py): from 5 rows for 4-bit codes, from 33 for 8-bit. Tiles of
   6 rows x 64 outputs (the same 24 accumulators, 4 weight loads and 6 broadcasts a step)
   measured the same within noise (512 rows 0.55-0.60x, 64 rows 0.50-0.58x, another run). */
#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

#define QV_MR 8
#define QV_NP 48

enum { QV_U8 = 0, QV_U4 = 1 };

/* The block of features x is quantized in: the largest of 128, 64, 32 dividing the group
   (smaller blocks round x more finely, larger ones fold less often). */
static inline int64_t qv_block(int64_t gs) { return gs % 128 == 0 ? 128 : gs % 64 == 0 ? 64 : 32; }

/* Whether qvnni_u8 / qvnni_u4 take codes of `bits` bits in groups of gs features, K of them
   (minisgl/quant/cpu_panel.py asks). */
int qvnni_takes(int bits, int64_t K, int64_t gs) {
    return (bits == 4 || bits == 8) && gs > 0 && gs % 32 == 0 && K % gs == 0 && K % 64 == 0;
}

/* Block of B features from x[at] -> B int8 codes into q, its scale (returned) and the sum of
   its codes (*sum). Also qvpanel.c's rounding of x to 8 bits (the same codes there). */
float qv_quantize_block(const void* x, int x_bf16, int64_t at, int64_t B, int8_t* q,
                               int32_t* sum) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < B; k += 16)
        mx = _mm512_max_ps(mx, _mm512_and_ps(load16_x(x, x_bf16, at + k), abs_mask));
    float amax = _mm512_reduce_max_ps(mx);
    float s = amax > 0 && isfinite(amax) ? amax / 127.0f : 1.0f;
    __m512 inv = _mm512_set1_ps(1.0f / s);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    __m512i cs = _mm512_setzero_si512();
    for (int64_t k = 0; k < B; k += 16) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load16_x(x, x_bf16, at + k), inv));
        c = _mm512_max_epi32(_mm512_min_epi32(c, top), bottom);
        cs = _mm512_add_epi32(cs, c);
        _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(c));
    }
    *sum = _mm512_reduce_add_epi32(cs);
    return s;
}

/* x row m -> its tile's column m % QV_MR: codes in xt ([K/4][QV_MR] dwords), per block b the
   scale sx[b * QV_MR + i] and the code sum xs[...] (as a float: exact, |sum| < 2^24). */
static void qv_quantize_row(const void* x, int x_bf16, int64_t m, int64_t K, int64_t B,
                            int8_t* row, int32_t* xt, float* sx, float* xs) {
    const int i = (int)(m % QV_MR);
    for (int64_t b = 0; b < K / B; b++) {
        int32_t sum;
        sx[b * QV_MR + i] = qv_quantize_block(x, x_bf16, m * K + b * B, B, row + b * B, &sum);
        xs[b * QV_MR + i] = (float)sum;
    }
    const int32_t* words = (const int32_t*)row;
    for (int64_t p = 0; p < K / 4; p++) xt[p * QV_MR + i] = words[p];
}

/* 64 features of a row of 4-bit codes (32 bytes, feature 2j in byte j's low nibble) -> 64
   bytes in feature order. */
static inline __m512i qv_nibbles(const uint8_t* c) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)c));
    __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(0x000F));
    __m512i hi = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F00));
    return _mm512_or_si512(lo, hi);
}

/* Weight rows n0..n0+47 (those past N as zero codes, scales and zero points) -> wp
   ([K/4][48][4] bytes), sw and zf ([G][48]). */
static void qv_pack(int kind, const uint8_t* codes, int64_t cstride, const float* scales,
                    const uint8_t* zeros, int64_t gstride, int64_t n0, int64_t N, int64_t K,
                    int64_t gs, uint8_t* wp, float* sw, float* zf) {
    const int64_t G = K / gs;
    for (int64_t s = 0; s < QV_NP; s += 16) {
        for (int64_t k = 0; k < K; k += 64) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                int64_t n = n0 + s + i;
                const uint8_t* c = codes + n * cstride;
                r[i] = n >= N          ? _mm512_setzero_si512()
                       : kind == QV_U8 ? _mm512_loadu_si512(c + k)
                                       : qv_nibbles(c + k / 2);
            }
            transpose16(r); /* r[j]: dword j (features k+4j..) of the 16 rows */
            for (int j = 0; j < 16; j++)
                _mm512_store_si512(wp + ((k / 4 + j) * QV_NP + s) * 4, r[j]);
        }
        for (int64_t g = 0; g < G; g++)
            for (int i = 0; i < 16; i++) {
                int64_t n = n0 + s + i;
                sw[g * QV_NP + s + i] = n < N ? scales[n * gstride + g] : 0.0f;
                zf[g * QV_NP + s + i] = n < N ? (float)zeros[n * gstride + g] : 0.0f;
            }
    }
}

/* One block's exact sums of 16 outputs into their fp32 sums fo: s_w * s_x * (acc - z * xsum). */
static inline __attribute__((always_inline)) void qv_fold(__m512i acc, const float* sw,
                                                          const float* zf, __m512 xsum,
                                                          __m512 xscale, float* fo) {
    __m512 t = _mm512_fnmadd_ps(_mm512_load_ps(zf), xsum, _mm512_cvtepi32_ps(acc));
    __m512 u = _mm512_mul_ps(_mm512_load_ps(sw), xscale);
    _mm512_store_ps(fo, _mm512_fmadd_ps(t, u, _mm512_load_ps(fo)));
}

/* A tile's row i (0..QV_MR-1): its 3 accumulators, a step of 4 features, a block's fold. */
#define QV_ACC(i) __m512i c##i##0 = zero, c##i##1 = zero, c##i##2 = zero;
#define QV_STEP(i)                                                       \
    {                                                                    \
        __m512i xv = _mm512_set1_epi32(xb[p * QV_MR + i]);               \
        c##i##0 = _mm512_dpbusd_epi32(c##i##0, w0, xv);                  \
        c##i##1 = _mm512_dpbusd_epi32(c##i##1, w1, xv);                  \
        c##i##2 = _mm512_dpbusd_epi32(c##i##2, w2, xv);                  \
    }
#define QV_KEEP(i)                                  \
    _mm512_store_si512(acc + (3 * i + 0) * 16, c##i##0); \
    _mm512_store_si512(acc + (3 * i + 1) * 16, c##i##1); \
    _mm512_store_si512(acc + (3 * i + 2) * 16, c##i##2);
#define QV_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

/* A tile of QV_MR rows of x (xt, sx, xs as qv_quantize_row lays them; rows past M zeros)
   against a packed panel -> f ([QV_MR][48] fp32 sums); always all QV_MR rows (named
   accumulators, no row count to specialize on). */
static void qv_tile(const int32_t* xt, const float* sx, const float* xs, const uint8_t* wp,
                    const float* sw, const float* zf, int64_t K, int64_t B, int64_t gs,
                    float* f) {
    for (int i = 0; i < QV_MR * QV_NP; i += 16) _mm512_store_ps(f + i, _mm512_setzero_ps());
    /* the block's exact sums, stored once a block: folding straight from the registers, GCC
       12 stored every accumulator to the stack at every step of the loop */
    int32_t acc[QV_MR * QV_NP] __attribute__((aligned(64)));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < K / B; b++) {
        QV_ROWS(QV_ACC)
        const int32_t* xb = xt + b * (B / 4) * QV_MR;
        const uint8_t* wb = wp + b * (B / 4) * QV_NP * 4;
        for (int64_t p = 0; p < B / 4; p++) {
            __m512i w0 = _mm512_load_si512(wb + p * QV_NP * 4);
            __m512i w1 = _mm512_load_si512(wb + p * QV_NP * 4 + 64);
            __m512i w2 = _mm512_load_si512(wb + p * QV_NP * 4 + 128);
            QV_ROWS(QV_STEP)
        }
        QV_ROWS(QV_KEEP)
        const float* sg = sw + b * B / gs * QV_NP;
        const float* zg = zf + b * B / gs * QV_NP;
        for (int i = 0; i < QV_MR; i++) {
            __m512 xsum = _mm512_set1_ps(xs[b * QV_MR + i]);
            __m512 xscale = _mm512_set1_ps(sx[b * QV_MR + i]);
            for (int j = 0; j < 3; j++)
                qv_fold(_mm512_load_si512(acc + (3 * i + j) * 16), sg + 16 * j, zg + 16 * j,
                        xsum, xscale, f + i * QV_NP + 16 * j);
        }
    }
}

/* f's `mr` rows -> y rows m0.., outputs n0..n0+47 (bounded by N). */
static void qv_store(const float* f, int mr, void* y, int out_bf16, int64_t m0, int64_t n0,
                     int64_t N) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 3; j++) {
            int64_t cols = N - n0 - 16 * j;
            if (cols <= 0) break;
            __mmask16 mask = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
            __m512 v = _mm512_load_ps(f + i * QV_NP + 16 * j);
            int64_t at = (m0 + i) * N + n0 + 16 * j;
            /* not VCVTNEPS2BF16: VNNI CPUs without AVX512-BF16 (Ice Lake) run this too */
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t*)y + at, mask, pack16_bf16(v));
            else
                _mm512_mask_storeu_ps((float*)y + at, mask, v);
        }
}

static void qvnni_kind(int kind, const void* x, int x_bf16, const uint8_t* codes,
                       int64_t cstride, const float* scales, const uint8_t* zeros,
                       int64_t gstride, void* y, int out_bf16, int64_t M, int64_t N, int64_t K,
                       int64_t gs) {
    const int64_t B = qv_block(gs), nb = K / B, G = K / gs;
    const int64_t tiles = (M + QV_MR - 1) / QV_MR, panels = (N + QV_NP - 1) / QV_NP;
    int32_t* xt = (int32_t*)aligned_alloc(64, (size_t)(tiles * QV_MR * K + 64));
    float* sx = (float*)malloc(sizeof(float) * tiles * QV_MR * nb);
    float* xs = (float*)malloc(sizeof(float) * tiles * QV_MR * nb);
    /* about 4 items a thread: with few panels, each panel's tiles are split in parts */
    const int threads = omp_get_max_threads();
    int64_t split = panels >= 4 * threads ? 1 : (4 * threads + panels - 1) / panels;
    if (split > tiles) split = tiles;
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    const int parts = share_parts();
    shares_init(shares, parts, panels * split);
    /* the last tile's rows past M: zero codes and scales (their sums are not stored) */
    for (int64_t m = M; m < tiles * QV_MR; m++)
        for (int64_t p = 0; p < K / 4; p++) xt[(m / QV_MR) * QV_MR * (K / 4) + p * QV_MR + m % QV_MR] = 0;
    for (int64_t m = M; m < tiles * QV_MR; m++)
        for (int64_t b = 0; b < nb; b++) {
            sx[(m / QV_MR) * QV_MR * nb + b * QV_MR + m % QV_MR] = 0.0f;
            xs[(m / QV_MR) * QV_MR * nb + b * QV_MR + m % QV_MR] = 0.0f;
        }
    #pragma omp parallel
    {
        int8_t* row = (int8_t*)malloc((size_t)K);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const int64_t t = m / QV_MR;
            qv_quantize_row(x, x_bf16, m, K, B, row, xt + t * QV_MR * (K / 4),
                            sx + t * QV_MR * nb, xs + t * QV_MR * nb);
        }
        free(row);
        uint8_t* wp = (uint8_t*)aligned_alloc(64, (size_t)(QV_NP * K));
        float* sw = (float*)aligned_alloc(64, sizeof(float) * 2 * G * QV_NP);
        float* zf = sw + G * QV_NP;
        float f[QV_MR * QV_NP] __attribute__((aligned(64)));
        int64_t have = -1;
        const int me = omp_get_thread_num();
        for (int64_t item; (item = share_next(shares, parts, me)) >= 0;) {
            const int64_t q = item / split, part = item % split;
            if (q != have) {
                qv_pack(kind, codes, cstride, scales, zeros, gstride, q * QV_NP, N, K, gs, wp,
                        sw, zf);
                have = q;
            }
            for (int64_t t = tiles * part / split; t < tiles * (part + 1) / split; t++) {
                const int64_t m0 = t * QV_MR;
                const int mr = M - m0 < QV_MR ? (int)(M - m0) : QV_MR;
                qv_tile(xt + t * QV_MR * (K / 4), sx + t * QV_MR * nb, xs + t * QV_MR * nb, wp,
                        sw, zf, K, B, gs, f);
                qv_store(f, mr, y, out_bf16, m0, q * QV_NP, N);
            }
        }
        free(wp);
        free(sw);
    }
    free(xt);
    free(sx);
    free(xs);
}

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (bf16 or fp32) in 8 bits @ W.T; the
   arguments are qgemv.c's (zero points required: integer codes always have them). Callers
   check qvnni_takes first. */
#define QVNNI(NAME, KIND)                                                                   \
    void NAME(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,            \
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y,         \
              int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {                  \
        qvnni_kind(KIND, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, \
                   N, K, gs);                                                              \
    }
QVNNI(qvnni_u8, QV_U8)
QVNNI(qvnni_u4, QV_U4)

#else
typedef int qvnni_not_built; /* no AVX512-VNNI in this build: no entry points (cpu_kernels.py) */
#endif
