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
   Groups are contiguous runs of gs input features (gs % 32 == 0, K % gs == 0). */
#include "common.h"

enum { QD_U8 = 0, QD_U4 = 1, QD_FP8 = 2 };

#define QKC 256   /* k per tile pass: the chunk of the segment the tiles keep in L1 (16 KB) */
#define QSEG 2048 /* k per dequantized segment: 16 x QSEG fp32 = 128 KB, within L2 */
#define QMB 120   /* input rows per pass over a chunk: their sums wait in `acc` between */

/* 8 e4m3 bytes (the low 8 of v) -> their values times 2^-8 as fp32 (sign kept, exponent and
   mantissa moved down one bit into an fp16: exact, subnormals included). */
static inline __m256 qd_fp8x8(__m128i v) {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), v);
    h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

/* Row n's features [k0, k0 + kc) dequantized into out[0..kc) (fp32, row-major). */
static inline __attribute__((always_inline)) void dequant_row(
    int kind, const uint8_t* c, const float* scales, const uint8_t* zeros, int64_t k0,
    int64_t kc, int64_t gs, float* out) {
    for (int64_t k = k0; k < k0 + kc; k += 16) {
        int64_t g = k / gs; /* a 16-run never crosses a group (gs % 32 == 0) */
        __m256 s = _mm256_set1_ps(kind == QD_FP8 ? scales[g] * 256.0f : scales[g]);
        __m256 w0, w1;
        if (kind == QD_FP8) {
            __m128i v = _mm_loadu_si128((const __m128i*)(c + k));
            w0 = _mm256_mul_ps(qd_fp8x8(v), s);
            w1 = _mm256_mul_ps(qd_fp8x8(_mm_unpackhi_epi64(v, v)), s);
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

/* rows[i][0..8) for i < 8 -> dst[j * 16 + i] = rows[i][j]: an 8x8 transpose in registers. */
static inline void transpose8(const float* src, int64_t ld, float* dst) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld);
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
