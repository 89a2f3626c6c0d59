/* Many input rows (prefill) over quantized weights: y[M, N] = x[M, K] @ W.T, W as
   minisgl/quant/qtensor.py holds it (codes, per-row per-group scales and zero points).

   Why not the dequantize-then-GEMM path (qgemv.c's qdequant_* and the fp32 GEMM): it writes a
   chunk of rows out as fp32 (twice the bytes bf16 weights have) and the GEMM then reads that
   back and repacks it into its panels for every 192 input rows, so a prefill paid the
   dequantization, a round trip through memory and the repacking on top of bf16's own
   arithmetic (measured on a 2-core Zen 3: 0.83-0.93x of the bf16 model's prefill).

   Here each thread takes 16 output rows (a panel) at a time, dequantizes a segment of their K
   straight into fp32 laid out [k][16] (the layout the bf16 panel kernel's tiles read, panel.c)
   ONCE for all M input rows, and runs register tiles of up to 6 input rows x 16 outputs over
   it (12 accumulators, one FMA each per k). The segment (16 x QSEG fp32, 128 KB) stays in L2
   while every input row passes over it, so the dequantization costs ~1/M of the
   arithmetic per weight, and no weight byte is read twice from memory.

   The values are qtensor.dequantize's exactly: (code - zero) as an exact fp32 difference, one
   rounding in the multiply by the scale (fp8 e4m3: a byte widened through fp16, times 2^-8
   folded into the scale, as in qgemv.c); products and sums in fp32.
   Groups are contiguous runs of gs input features (gs % 32 == 0, K % gs == 0; 8-bit codes
   also gs == 16: GGUF's Q6_K, Q3_K and Q2_K where the build has no VNNI panels). */
#include "common.h"
#include "fp8.h"

enum { QD_U8 = 0, QD_U4 = 1, QD_FP8 = 2 };

#define QKC 256   /* k per tile pass: the chunk of the segment the tiles keep in L1 (16 KB) */
#define QSEG 2048 /* k per dequantized segment: 16 x QSEG fp32 = 128 KB, within L2 */
#define QMB 120   /* input rows per pass over a chunk: their sums wait in `acc` between */

/* Row n's features [k0, k0 + kc) dequantized into out[0..kc) (fp32, row-major). */
static inline __attribute__((always_inline)) void dequant_row(
    int kind, const uint8_t* c, const float* scales, const uint8_t* zeros, int64_t k0,
    int64_t kc, int64_t gs, float* out) {
    for (int64_t k = k0; k < k0 + kc; k += 16) {
        int64_t g = k / gs; /* a 16-run never crosses a group (gs % 16 == 0) */
        __m256 s = _mm256_set1_ps(kind == QD_FP8 ? scales[g] * 256.0f : scales[g]);
        __m256 w0, w1;
        if (kind == QD_FP8) {
            __m128i v = _mm_loadu_si128((const __m128i*)(c + k));
            w0 = _mm256_mul_ps(e4m3x8_low(v), s);
            w1 = _mm256_mul_ps(e4m3x8_low(_mm_unpackhi_epi64(v, v)), s);
        } else {
            __m128i both;
            if (kind == QD_U8) {
                both = _mm_loadu_si128((const __m128i*)(c + k));
            } else { /* 8 bytes: 16 codes, feature 2j in the low nibble */
                __m128i v = _mm_loadl_epi64((const __m128i*)(c + k / 2));
                __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
                __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
                both = _mm_unpacklo_epi8(lo, hi);
            }
            __m256 z = _mm256_set1_ps((float)zeros[g]);
            w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
            w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(both, both)));
            w0 = _mm256_mul_ps(_mm256_sub_ps(w0, z), s);
            w1 = _mm256_mul_ps(_mm256_sub_ps(w1, z), s);
        }
        _mm256_storeu_ps(out + (k - k0), w0);
        _mm256_storeu_ps(out + (k - k0) + 8, w1);
    }
}

/* rows[i][0..8) for i < 8 -> dst[j * 16 + i] = rows[i][j] (common.h's transpose). */
static inline void transpose8(const float* src, int64_t ld, float* dst) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld);
    transpose8_store(r, dst);
}

/* Panel rows n0..n0+15 (those past N as zeros), features [s0, s0 + len), into seg[len][16].
   `rowbuf` [16][QKC]: one chunk of the 16 rows dequantized row-major, then transposed. */
static inline __attribute__((always_inline)) void dequant_segment(
    int kind, const uint8_t* codes, int64_t cstride, const float* scales,
    const uint8_t* zeros, int64_t gstride, int64_t n0, int64_t N, int64_t s0, int64_t len,
    int64_t gs, float* rowbuf, float* seg) {
    for (int64_t c0 = 0; c0 < len; c0 += QKC) {
        int64_t kc = len - c0 < QKC ? len - c0 : QKC;
        for (int j = 0; j < 16; j++) {
            int64_t n = n0 + j;
            float* out = rowbuf + j * QKC;
            if (n >= N) {
                for (int64_t k = 0; k < kc; k++) out[k] = 0.f;
                continue;
            }
            dequant_row(kind, codes + n * cstride, scales + n * gstride,
                        zeros ? zeros + n * gstride : 0, s0 + c0, kc, gs, out);
        }
        for (int64_t k = 0; k < kc; k += 8)
            for (int h = 0; h < 2; h++)
                transpose8(rowbuf + h * 8 * QKC + k, QKC, seg + (c0 + k) * 16 + h * 8);
    }
}

/* R input rows x 16 outputs over kc features: acc[i * 16 + c] += x[i, k] * w[k][c]. */
#define QTILE(NAME, R)                                                                        \
static inline void NAME(const float* x, int64_t ldx, int64_t kc, const float* w, float* acc) { \
    __m256 e[R], o[R];                                                                        \
    for (int i = 0; i < R; i++) {                                                             \
        e[i] = _mm256_loadu_ps(acc + 16 * i);                                                 \
        o[i] = _mm256_loadu_ps(acc + 16 * i + 8);                                             \
    }                                                                                         \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; k++) {                               \
        __m256 we = _mm256_loadu_ps(w + k * 16), wo = _mm256_loadu_ps(w + k * 16 + 8);        \
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {                                 \
            __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                                  \
            e[i] = _mm256_fmadd_ps(a, we, e[i]);                                              \
            o[i] = _mm256_fmadd_ps(a, wo, o[i]);                                              \
        }                                                                                     \
    }                                                                                         \
    for (int i = 0; i < R; i++) {                                                             \
        _mm256_storeu_ps(acc + 16 * i, e[i]);                                                 \
        _mm256_storeu_ps(acc + 16 * i + 8, o[i]);                                             \
    }                                                                                         \
}
QTILE(qtile6, 6)
QTILE(qtile4, 4)
QTILE(qtile2, 2)
QTILE(qtile1, 1)

/* Input rows [m0, m0 + mb) against one dequantized segment (features [s0, s0 + len)). */
static void segment_rows(const float* x, int64_t K, int64_t m0, int64_t mb, int64_t s0,
                         int64_t len, const float* seg, float* acc) {
    for (int64_t c0 = 0; c0 < len; c0 += QKC) {
        int64_t kc = len - c0 < QKC ? len - c0 : QKC;
        const float* w = seg + c0 * 16;
        for (int64_t m = 0; m < mb;) {
            int64_t left = mb - m;
            const float* xm = x + (m0 + m) * K + s0 + c0;
            float* am = acc + (m0 + m) * 16;
            if (left >= 6) { qtile6(xm, K, kc, w, am); m += 6; }
            else if (left >= 4) { qtile4(xm, K, kc, w, am); m += 4; }
            else if (left >= 2) { qtile2(xm, K, kc, w, am); m += 2; }
            else { qtile1(xm, K, kc, w, am); m += 1; }
        }
    }
}

static inline __attribute__((always_inline)) void qpanel_kind(
    int kind, const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
    const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
    int64_t M, int64_t N, int64_t K, int64_t gs) {
    const float* xf = (const float*)x;
    float* conv = 0;
    if (x_bf16) {
        conv = (float*)malloc(sizeof(float) * M * K);
        const uint16_t* xb = (const uint16_t*)x;
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < M * K; i++) conv[i] = bf16_to_f32(xb[i]);
        xf = conv;
    }
    int64_t panels = (N + 15) / 16, seglen = K < QSEG ? K : QSEG;
    #pragma omp parallel
    {
        float* seg = (float*)aligned_alloc(64, sizeof(float) * 16 * seglen);
        float* rowbuf = (float*)aligned_alloc(64, sizeof(float) * 16 * QKC);
        float* acc = (float*)aligned_alloc(64, sizeof(float) * 16 * M);
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; q++) {
            int64_t n0 = q * 16;
            for (int64_t i = 0; i < 16 * M; i++) acc[i] = 0.f;
            for (int64_t s0 = 0; s0 < K; s0 += seglen) {
                int64_t len = K - s0 < seglen ? K - s0 : seglen;
                dequant_segment(kind, codes, cstride, scales, zeros, gstride, n0, N, s0, len, gs,
                                rowbuf, seg);
                for (int64_t m0 = 0; m0 < M; m0 += QMB)
                    segment_rows(xf, K, m0, M - m0 < QMB ? M - m0 : QMB, s0, len, seg, acc);
            }
            int cols = N - n0 < 16 ? (int)(N - n0) : 16;
            for (int64_t i = 0; i < M; i++)
                for (int c = 0; c < cols; c++)
                    store(y, i * N + n0 + c, acc[i * 16 + c], out_bf16);
        }
        free(seg);
        free(rowbuf);
        free(acc);
    }
    free(conv);
}

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (fp32, or bf16 where x_bf16) @ W.T; W's
   row n has its codes at codes + n * cstride (bytes), its groups' scales (zero points) at
   scales (zeros) + n * gstride. The arguments are qgemv.c's. */
#define QPANEL(NAME, KIND)                                                                    \
    void NAME(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,             \
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y,          \
              int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {                   \
        qpanel_kind(KIND, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, \
                    N, K, gs);                                                              \
    }
QPANEL(qpanel_u8, QD_U8)
QPANEL(qpanel_u4, QD_U4)
QPANEL(qpanel_fp8, QD_FP8)

/* ---- Integer codes against 16-bit integer activations (qpanel16_*) ----------------------

   On AVX2 without VNNI one VPMADDWD multiplies 16 pairs of int16 and adds them in pairs, and
   with the VPADDD that accumulates it the core issues twice the multiply-adds per cycle that
   fp32 FMAs give (measured on a 2-core Zen 3: 152 against 76 G per second per core): the
   FMAs run on two pipes, the integer multiplies and adds spread over four. Codes are small
   integers (u8 0..255, u4 0..15) and x is quantized per row to int16 exactly as the decode
   GEMV does it (qgemv.c: one scale, max|x| / 32767), so

     y[m, n] = xs[m] * sum_g s[n, g] * (sum_{k in g} xq[m, k] * c[n, k] - z[n, g] * xsum[m, g])

   with the inner sums exact in int32. A panel's codes are widened once per call into int16
   pairs, [k/2][16 outputs][2 features], so one 32-bit broadcast of x's pair (k, k+1) meets 8
   outputs' pairs per VPMADDWD; tiles of 6 input rows x 16 outputs keep 12 int32 sums in
   registers and fold them into fp32 (scale, zero point) at the end of each run of at most
   256 features within a group (u8 codes: 128 pairs of 2 * 255 * 32767 stay inside int32). */

#define Q16_RUN 256 /* features summed in int32 before they are folded into fp32 */

/* x row m -> int16 [K] and its scale; sums of each run of `run` features. */
static void q16_quantize_x(const void* x, int x_bf16, int64_t m, int64_t K, int64_t run,
                           int16_t* xq, float* xscale, int32_t* xsum) {
    const float* xf = (const float*)x + m * K;
    const uint16_t* xb = (const uint16_t*)x + m * K;
    float amax = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = fabsf(x_bf16 ? bf16_to_f32(xb[k]) : xf[k]);
        amax = v > amax ? v : amax;
    }
    float s = amax > 0 ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
    xscale[m] = s;
    int64_t runs = K / run;
    for (int64_t r = 0; r < runs; r++) {
        int32_t sum = 0;
        for (int64_t k = r * run; k < (r + 1) * run; k++) {
            float v = x_bf16 ? bf16_to_f32(xb[k]) : xf[k];
            int32_t c = (int32_t)lrintf(v * inv);
            c = c > 32767 ? 32767 : (c < -32767 ? -32767 : c);
            sum += c;
            xq[m * K + k] = (int16_t)c;
        }
        xsum[m * runs + r] = sum;
    }
}

/* 8 codes of row n from feature k as 8 int16. */
static inline __attribute__((always_inline)) __m128i q16_codes8(int kind, const uint8_t* c,
                                                                int64_t k) {
    if (kind == QD_U8) return _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(c + k)));
    /* 4 bytes, feature 2j in the low nibble of byte j */
    int32_t word;
    __builtin_memcpy(&word, c + k / 2, 4); /* unaligned, and no type punning */
    __m128i v = _mm_cvtsi32_si128(word);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    return _mm_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
}

/* Panel rows n0..n0+15 (past N: zeros), features [s0, s0 + len) -> wide[len/2][16][2]. */
static inline __attribute__((always_inline)) void q16_widen_segment(
    int kind, const uint8_t* codes, int64_t cstride, int64_t n0, int64_t N, int64_t s0,
    int64_t len, int16_t* wide) {
    for (int h = 0; h < 2; h++) {
        const uint8_t* rows[8];
        for (int j = 0; j < 8; j++) {
            int64_t n = n0 + h * 8 + j;
            rows[j] = n < N ? codes + n * cstride : 0;
        }
        for (int64_t k = 0; k < len; k += 8) {
            __m128i r[8];
            for (int j = 0; j < 8; j++)
                r[j] = rows[j] ? q16_codes8(kind, rows[j], s0 + k) : _mm_setzero_si128();
            /* rows j and j+4 side by side; then pairs (32 bits) transposed 8 rows x 4 pairs */
            __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(r[0]), r[4], 1);
            __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(r[1]), r[5], 1);
            __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(r[2]), r[6], 1);
            __m256i d = _mm256_inserti128_si256(_mm256_castsi128_si256(r[3]), r[7], 1);
            __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
            __m256i t2 = _mm256_unpacklo_epi32(c, d), t3 = _mm256_unpackhi_epi32(c, d);
            int16_t* out = wide + (k / 2) * 32 + h * 16;
            _mm256_storeu_si256((__m256i*)(out + 0 * 32), _mm256_unpacklo_epi64(t0, t2));
            _mm256_storeu_si256((__m256i*)(out + 1 * 32), _mm256_unpackhi_epi64(t0, t2));
            _mm256_storeu_si256((__m256i*)(out + 2 * 32), _mm256_unpacklo_epi64(t1, t3));
            _mm256_storeu_si256((__m256i*)(out + 3 * 32), _mm256_unpackhi_epi64(t1, t3));
        }
    }
}

/* R input rows x 16 outputs over one run (`pairs` feature pairs, one group): the int32 sums,
   then acc[i][c] += s[c] * (sum - z[c] * xsum[i]). `xs` rows are `ldx` int16 apart, `xsum`
   values `lds` apart. */
#define Q16TILE(NAME, R)                                                                      \
static inline void NAME(const int16_t* x, int64_t ldx, int64_t pairs, const int16_t* w,      \
                        const float* sc, const float* zf, const int32_t* xsum, int64_t lds,  \
                        float* acc) {                                                        \
    __m256i e[R], o[R];                                                                      \
    for (int i = 0; i < R; i++) e[i] = o[i] = _mm256_setzero_si256();                        \
    _Pragma("GCC unroll 2") for (int64_t p = 0; p < pairs; p++) {                           \
        __m256i we = _mm256_loadu_si256((const __m256i*)(w + p * 32));                       \
        __m256i wo = _mm256_loadu_si256((const __m256i*)(w + p * 32 + 16));                  \
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {                                \
            int32_t pair;                                                                    \
            __builtin_memcpy(&pair, x + i * ldx + 2 * p, 4);                                 \
            __m256i a = _mm256_set1_epi32(pair);                                             \
            e[i] = _mm256_add_epi32(e[i], _mm256_madd_epi16(we, a));                         \
            o[i] = _mm256_add_epi32(o[i], _mm256_madd_epi16(wo, a));                         \
        }                                                                                    \
    }                                                                                        \
    __m256 se = _mm256_loadu_ps(sc), so = _mm256_loadu_ps(sc + 8);                           \
    __m256 ze = _mm256_loadu_ps(zf), zo = _mm256_loadu_ps(zf + 8);                           \
    for (int i = 0; i < R; i++) {                                                            \
        __m256 xsm = _mm256_set1_ps((float)xsum[i * lds]);                                   \
        __m256 de = _mm256_fnmadd_ps(ze, xsm, _mm256_cvtepi32_ps(e[i]));                     \
        __m256 dO = _mm256_fnmadd_ps(zo, xsm, _mm256_cvtepi32_ps(o[i]));                     \
        _mm256_storeu_ps(acc + 16 * i, _mm256_fmadd_ps(de, se, _mm256_loadu_ps(acc + 16 * i))); \
        _mm256_storeu_ps(acc + 16 * i + 8,                                                   \
                         _mm256_fmadd_ps(dO, so, _mm256_loadu_ps(acc + 16 * i + 8)));        \
    }                                                                                        \
}
Q16TILE(q16tile6, 6)
Q16TILE(q16tile4, 4)
Q16TILE(q16tile2, 2)
Q16TILE(q16tile1, 1)

static inline __attribute__((always_inline)) void qpanel16_kind(
    int kind, const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
    const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
    int64_t M, int64_t N, int64_t K, int64_t gs) {
    /* runs: the largest multiple of 32 dividing gs, at most Q16_RUN (never across a group) */
    int64_t run = 32;
    for (int64_t r = Q16_RUN; r >= 32; r -= 32)
        if (gs % r == 0) { run = r; break; }
    int64_t runs = K / run, G = K / gs;
    int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * M * K);
    float* xscale = (float*)malloc(sizeof(float) * M);
    int32_t* xsum = (int32_t*)malloc(sizeof(int32_t) * M * runs);
    #pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) q16_quantize_x(x, x_bf16, m, K, run, xq, xscale, xsum);
    /* segments: whole runs */
    int64_t panels = (N + 15) / 16, seglen = K < QSEG ? K : QSEG / run * run;
    #pragma omp parallel
    {
        int16_t* wide = (int16_t*)aligned_alloc(64, sizeof(int16_t) * 16 * seglen);
        float* acc = (float*)aligned_alloc(64, sizeof(float) * 16 * M);
        float* sc = (float*)aligned_alloc(64, sizeof(float) * 16 * G);
        float* zf = (float*)aligned_alloc(64, sizeof(float) * 16 * G);
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; q++) {
            int64_t n0 = q * 16;
            for (int64_t g = 0; g < G; g++)
                for (int c = 0; c < 16; c++) {
                    int64_t n = n0 + c < N ? n0 + c : N - 1; /* past N: any row, dropped */
                    sc[g * 16 + c] = scales[n * gstride + g];
                    zf[g * 16 + c] = (float)zeros[n * gstride + g];
                }
            for (int64_t i = 0; i < 16 * M; i++) acc[i] = 0.f;
            for (int64_t s0 = 0; s0 < K; s0 += seglen) {
                int64_t len = K - s0 < seglen ? K - s0 : seglen;
                q16_widen_segment(kind, codes, cstride, n0, N, s0, len, wide);
                for (int64_t m0 = 0; m0 < M; m0 += QMB) {
                    int64_t mb = M - m0 < QMB ? M - m0 : QMB;
                    for (int64_t r0 = 0; r0 < len; r0 += run) {
                        int64_t k = s0 + r0, g = k / gs, r = k / run;
                        const int16_t* w = wide + (r0 / 2) * 32;
                        const float *s = sc + g * 16, *z = zf + g * 16;
                        for (int64_t m = m0; m < m0 + mb;) {
                            int64_t left = m0 + mb - m;
                            const int16_t* xm = xq + m * K + k;
                            const int32_t* xs = xsum + m * runs + r;
                            float* am = acc + m * 16;
                            if (left >= 6) { q16tile6(xm, K, run / 2, w, s, z, xs, runs, am); m += 6; }
                            else if (left >= 4) { q16tile4(xm, K, run / 2, w, s, z, xs, runs, am); m += 4; }
                            else if (left >= 2) { q16tile2(xm, K, run / 2, w, s, z, xs, runs, am); m += 2; }
                            else { q16tile1(xm, K, run / 2, w, s, z, xs, runs, am); m += 1; }
                        }
                    }
                }
            }
            int cols = N - n0 < 16 ? (int)(N - n0) : 16;
            for (int64_t i = 0; i < M; i++) {
                float xs = xscale[i];
                for (int c = 0; c < cols; c++)
                    store(y, i * N + n0 + c, acc[i * 16 + c] * xs, out_bf16);
            }
        }
        free(wide);
        free(acc);
        free(sc);
        free(zf);
    }
    free(xq);
    free(xscale);
    free(xsum);
}

/* As qpanel_u8 / qpanel_u4 (the same arguments), with x quantized per row to int16. */
void qpanel16_u8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                 const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
                 int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    qpanel16_kind(QD_U8, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N,
                  K, gs);
}
void qpanel16_u4(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                 const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
                 int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    qpanel16_kind(QD_U4, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N,
                  K, gs);
}
