/* Matmuls over quantized weights (minisgl/quant/qtensor.py's layout), each code byte read once
   per call and widened in registers, never into a dequantized copy of the weight:

     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k] - zero[n, g] * xsum[m, g])

   Groups are contiguous runs of `gs` input features (gs % 32 == 0, K % gs == 0).

   Why not widen codes to fp32 and FMA (the first version): an 8-bit code then costs a widen, a
   convert and an FMA per weight, three times the instructions per byte of the bf16 GEMV, so it
   ran at a third to two thirds of bf16's speed instead of twice it. Here integer codes meet x
   as 16-bit integers: x is quantized per row (one scale, max|x| / 32767: 15 bits, far finer
   than the bf16 activations it comes from), a code widened to 16 bits once serves every input
   row, and one VPMADDWD does 16 products per input row. Sums stay exact in int32 over a group
   (at most FLUSH features, so they cannot overflow) and turn into fp32 once per group, where
   the scale and the zero point (through the group's integer sum of x) are applied to four
   output rows at once.

   4-bit: 16 bytes hold 32 codes; widened bytewise to 16-bit lanes, a mask gives the even
   features and a shift the odd ones, so x is laid out evens-then-odds per 32 to match.
   fp8 e4m3: no integer form; a byte becomes an fp16 with a shift and a mask (sign kept, the
   exponent and mantissa moved down one bit: the value times 2^-8 exactly, subnormals included)
   and F16C widens that to fp32 for an FMA; the 2^8 is folded into the group's scale.

   Blocks of 4 weight rows are split over the threads; each block is multiplied against the
   input rows two at a time (one at the end) while it stays in L1, and the next blocks are
   prefetched across all of those passes (common.h), as the bf16 GEMV does. */
#include "common.h"

/* Q_WIDE: integer codes already widened to int16 (a block's scratch, below). */
enum { Q_U8 = 0, Q_U4 = 1, Q_FP8 = 2, Q_WIDE = 3 };

/* acc + the pairwise int16 dot products of a and b (8 int32 lanes). With AVX512-VNNI (the
   AVX-512 build on a CPU that has it) one VPDPWSSD; otherwise VPMADDWD then VPADDD. */
#ifdef __AVX512VNNI__
#define DOT16(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#else
#define DOT16(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

/* Integer sums per lane within one flush: <= FLUSH / 16 pair sums of 2 * 255 * 32767 each. */
#define FLUSH 1024
#define XMAX 32767.0f

/* x row -> int16 codes (layout for `kind`) and its scale; per-group integer sums. */
static void quantize_x(int kind, const void* x, int x_bf16, int64_t m, int64_t K, int64_t gs,
                       int16_t* xq, float* xscale, float* xsum) {
    const float* xf = (const float*)x + m * K;
    const uint16_t* xb = (const uint16_t*)x + m * K;
    float amax = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = fabsf(x_bf16 ? bf16_to_f32(xb[k]) : xf[k]);
        amax = v > amax ? v : amax;
    }
    float s = amax > 0 ? amax / XMAX : 1.0f, inv = 1.0f / s;
    xscale[m] = s;
    int16_t* q = xq + m * K;
    int64_t G = K / gs;
    for (int64_t g = 0; g < G; g++) {
        int32_t sum = 0;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            float v = x_bf16 ? bf16_to_f32(xb[k]) : xf[k];
            int32_t c = (int32_t)lrintf(v * inv);
            c = c > 32767 ? 32767 : (c < -32767 ? -32767 : c);
            sum += c;
            /* 4-bit: within each 32, even features first, then odd ones */
            int64_t at = kind == Q_U4 ? (k & ~31) + ((k & 1) ? 16 : 0) + ((k & 31) >> 1) : k;
            q[at] = (int16_t)c;
        }
        xsum[m * G + g] = (float)sum;
    }
}

/* 32 integer codes from p -> two vectors of 16 int16 matching x's layout. */
static inline __attribute__((always_inline)) void widen_int(int kind, const uint8_t* p,
                                                              __m256i* a, __m256i* b) {
    if (kind == Q_WIDE) {
        *a = _mm256_loadu_si256((const __m256i*)p);
        *b = _mm256_loadu_si256((const __m256i*)(p + 32));
    } else if (kind == Q_U8) {
        *a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        *b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
    } else {
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        *a = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *b = _mm256_srli_epi16(v, 4);
    }
}

/* 8 e4m3 bytes -> their values times 2^-8 as fp32 (see the top). */
static inline __m256 fp8x8(__m128i bytes_lo8) {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes_lo8); /* byte << 8 per lane */
    h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

/* The four rows' scales (and zero points) of group g, as vectors. */
static inline __m128 four_f(const float* s, int64_t stride, int64_t g, const int* r) {
    return _mm_setr_ps(s[r[0] * stride + g], s[r[1] * stride + g], s[r[2] * stride + g],
                       s[r[3] * stride + g]);
}
static inline __m128 four_z(const uint8_t* z, int64_t stride, int64_t g, const int* r) {
    return _mm_setr_ps((float)z[r[0] * stride + g], (float)z[r[1] * stride + g],
                       (float)z[r[2] * stride + g], (float)z[r[3] * stride + g]);
}

/* One 4-row block against input rows m..m+MR-1 (MR 1 or 2), integer codes. */
static inline __attribute__((always_inline)) void block_int(
    int kind, int MR, const int16_t* xq, const float* xscale, const float* xsum,
    const uint8_t* const* wr, const int* r, const float* scales, const uint8_t* zeros,
    int64_t gstride, int64_t m, int64_t K, int64_t gs, Prefetch* pf, float out[2][4]) {
    int64_t G = K / gs, chunk = gs < FLUSH ? gs : FLUSH;
    int cb = kind == Q_U4 ? 16 : (kind == Q_WIDE ? 64 : 32); /* code bytes per 32 features */
    const int16_t* x0 = xq + m * K;
    const int16_t* x1 = MR == 2 ? x0 + K : x0;
    __m128 tot0 = _mm_setzero_ps(), tot1 = tot0;
    for (int64_t g = 0; g < G; g++) {
        __m128 sc = four_f(scales, gstride, g, r);
        __m128 z = kind == Q_FP8 ? _mm_setzero_ps() : four_z(zeros, gstride, g, r);
        __m128 sum0 = _mm_setzero_ps(), sum1 = sum0;
        for (int64_t c0 = g * gs; c0 < (g + 1) * gs; c0 += chunk) {
            __m256i a0[4], a1[4];
            for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_si256();
            for (int64_t k = c0; k < c0 + chunk; k += 32) {
                prefetch_step(pf);
                __m256i u0 = _mm256_loadu_si256((const __m256i*)(x0 + k));
                __m256i v0 = _mm256_loadu_si256((const __m256i*)(x0 + k + 16));
                __m256i u1 = _mm256_loadu_si256((const __m256i*)(x1 + k));
                __m256i v1 = _mm256_loadu_si256((const __m256i*)(x1 + k + 16));
                for (int j = 0; j < 4; j++) {
                    __m256i wa, wb;
                    widen_int(kind, wr[j] + k / 32 * cb, &wa, &wb);
                    a0[j] = DOT16(DOT16(a0[j], wa, u0), wb, v0);
                    if (MR == 2) a1[j] = DOT16(DOT16(a1[j], wa, u1), wb, v1);
                }
            }
            sum0 = _mm_add_ps(sum0, hsum4(_mm256_cvtepi32_ps(a0[0]), _mm256_cvtepi32_ps(a0[1]),
                                          _mm256_cvtepi32_ps(a0[2]), _mm256_cvtepi32_ps(a0[3])));
            if (MR == 2)
                sum1 = _mm_add_ps(sum1,
                                  hsum4(_mm256_cvtepi32_ps(a1[0]), _mm256_cvtepi32_ps(a1[1]),
                                        _mm256_cvtepi32_ps(a1[2]), _mm256_cvtepi32_ps(a1[3])));
        }
        /* (dot - zero * xsum) * scale, four output rows at once */
        sum0 = _mm_fnmadd_ps(z, _mm_set1_ps(xsum[m * G + g]), sum0);
        tot0 = _mm_fmadd_ps(sum0, sc, tot0);
        if (MR == 2) {
            sum1 = _mm_fnmadd_ps(z, _mm_set1_ps(xsum[(m + 1) * G + g]), sum1);
            tot1 = _mm_fmadd_ps(sum1, sc, tot1);
        }
    }
    _mm_storeu_ps(out[0], _mm_mul_ps(tot0, _mm_set1_ps(xscale[m])));
    if (MR == 2) _mm_storeu_ps(out[1], _mm_mul_ps(tot1, _mm_set1_ps(xscale[m + 1])));
}

/* The same for fp8 codes against fp32 x. */
static inline __attribute__((always_inline)) void block_fp8(
    int MR, const float* xf, const uint8_t* const* wr, const int* r, const float* scales,
    int64_t gstride, int64_t m, int64_t K, int64_t gs, Prefetch* pf, float out[2][4]) {
    int64_t G = K / gs;
    const float* x0 = xf + m * K;
    const float* x1 = MR == 2 ? x0 + K : x0;
    __m128 tot0 = _mm_setzero_ps(), tot1 = tot0;
    for (int64_t g = 0; g < G; g++) {
        __m256 a0[4], a1[4];
        for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
            prefetch_step(pf);
            for (int j = 0; j < 4; j++) {
                for (int h = 0; h < 32; h += 16) {
                    __m128i v = _mm_loadu_si128((const __m128i*)(wr[j] + k + h));
                    __m256 wa = fp8x8(v), wb = fp8x8(_mm_unpackhi_epi64(v, v));
                    a0[j] = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x0 + k + h), a0[j]);
                    a0[j] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(x0 + k + h + 8), a0[j]);
                    if (MR == 2) {
                        a1[j] = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x1 + k + h), a1[j]);
                        a1[j] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(x1 + k + h + 8), a1[j]);
                    }
                }
            }
        }
        __m128 sc = _mm_mul_ps(four_f(scales, gstride, g, r), _mm_set1_ps(256.0f));
        tot0 = _mm_fmadd_ps(hsum4(a0[0], a0[1], a0[2], a0[3]), sc, tot0);
        if (MR == 2) tot1 = _mm_fmadd_ps(hsum4(a1[0], a1[1], a1[2], a1[3]), sc, tot1);
    }
    _mm_storeu_ps(out[0], tot0);
    if (MR == 2) _mm_storeu_ps(out[1], tot1);
}

static inline __attribute__((always_inline)) void qgemv_kind(
    int kind, const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
    const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
    int64_t M, int64_t N, int64_t K, int64_t gs) {
    int64_t G = K / gs;
    int16_t* xq = NULL;
    float *xf = NULL, *xscale = NULL, *xsum = NULL;
    if (kind == Q_FP8) {
        xf = (float*)malloc(sizeof(float) * M * K);
        for (int64_t i = 0; i < M * K; i++)
            xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
    } else {
        xq = (int16_t*)malloc(sizeof(int16_t) * M * K);
        xscale = (float*)malloc(sizeof(float) * M);
        xsum = (float*)malloc(sizeof(float) * M * G);
        for (int64_t m = 0; m < M; m++) quantize_x(kind, x, x_bf16, m, K, gs, xq, xscale, xsum);
    }
    int64_t blocks = (N + 3) / 4;
    /* More than one pass over a block (M > 2): its integer codes are widened once into a
       scratch that stays in L1/L2, so the passes spend their instructions on products only. */
    int widen_once = kind != Q_FP8 && M > 2;
    #pragma omp parallel
    {
        int16_t* wide = widen_once ? (int16_t*)malloc(sizeof(int16_t) * 4 * K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t n0 = b * 4;
            int rows = N - n0 < 4 ? (int)(N - n0) : 4;
            int r[4];
            const uint8_t* wr[4];
            for (int j = 0; j < 4; j++) {
                r[j] = (int)(n0 + (j < rows ? j : 0));
                wr[j] = codes + r[j] * cstride;
            }
            int64_t block_bytes = 4 * cstride;
            Prefetch pf = {ahead(codes + n0 * cstride, block_bytes, n0 + 4 * PF_BLOCKS < N),
                           block_bytes / 64, K / 32 * ((M + 1) / 2), 0, 0};
            if (wide) {
                int cb = kind == Q_U4 ? 16 : 32;
                for (int j = 0; j < 4; j++) {
                    int16_t* dst = wide + j * K;
                    for (int64_t k = 0; k < K; k += 32) {
                        __m256i wa, wb;
                        widen_int(kind, wr[j] + k / 32 * cb, &wa, &wb);
                        _mm256_storeu_si256((__m256i*)(dst + k), wa);
                        _mm256_storeu_si256((__m256i*)(dst + k + 16), wb);
                    }
                    wr[j] = (const uint8_t*)dst;
                }
            }
            for (int64_t m = 0; m < M; m += 2) {
                float out[2][4];
                int mr = M - m >= 2 ? 2 : 1;
                if (kind == Q_FP8) {
                    if (mr == 2) block_fp8(2, xf, wr, r, scales, gstride, m, K, gs, &pf, out);
                    else block_fp8(1, xf, wr, r, scales, gstride, m, K, gs, &pf, out);
                } else if (wide) {
                    if (mr == 2)
                        block_int(Q_WIDE, 2, xq, xscale, xsum, wr, r, scales, zeros, gstride, m,
                                  K, gs, &pf, out);
                    else
                        block_int(Q_WIDE, 1, xq, xscale, xsum, wr, r, scales, zeros, gstride, m,
                                  K, gs, &pf, out);
                } else if (mr == 2) {
                    block_int(kind, 2, xq, xscale, xsum, wr, r, scales, zeros, gstride, m, K, gs,
                              &pf, out);
                } else {
                    block_int(kind, 1, xq, xscale, xsum, wr, r, scales, zeros, gstride, m, K, gs,
                              &pf, out);
                }
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < rows; j++)
                        store(y, (m + i) * N + n0 + j, out[i][j], out_bf16);
            }
        }
        free(wide);
    }
    free(xq);
    free(xf);
    free(xscale);
    free(xsum);
}

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (fp32, or bf16 where x_bf16) @ W.T; W's
   row n has its codes at codes + n * cstride, its groups' scales (zero points) at
   scales (zeros) + n * gstride. */
#define QGEMV(NAME, KIND)                                                                     \
    void NAME(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,             \
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y,          \
              int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {                   \
        qgemv_kind(KIND, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, \
                   N, K, gs);                                                               \
    }
QGEMV(qgemv_u8, Q_U8)
QGEMV(qgemv_u4, Q_U4)
QGEMV(qgemv_fp8, Q_FP8)

/* Rows [r0, r1) of W dequantized into out [r1 - r0, K] fp32: (code - zero) * scale, exact in
   fp32 for every format here. For many input rows (prefill) a chunk of rows is dequantized
   once and multiplied by the fp32 GEMM, instead of being widened once per input row. */
static inline __attribute__((always_inline)) void dequant_kind(
    int kind, const uint8_t* codes, int64_t cstride, const float* scales, const uint8_t* zeros,
    int64_t gstride, float* out, int64_t r0, int64_t r1, int64_t K, int64_t gs) {
    int64_t G = K / gs;
    #pragma omp parallel for schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t* c = codes + n * cstride;
        float* o = out + (n - r0) * K;
        for (int64_t g = 0; g < G; g++) {
            __m256 s = _mm256_set1_ps(scales[n * gstride + g] * (kind == Q_FP8 ? 256.0f : 1.0f));
            __m256 z = _mm256_set1_ps(kind == Q_FP8 ? 0.0f : (float)zeros[n * gstride + g]);
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
                __m256 w0, w1;
                if (kind == Q_FP8) {
                    __m128i v = _mm_loadu_si128((const __m128i*)(c + k));
                    w0 = fp8x8(v);
                    w1 = fp8x8(_mm_unpackhi_epi64(v, v));
                } else if (kind == Q_U8) {
                    __m128i v = _mm_loadu_si128((const __m128i*)(c + k));
                    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
                } else { /* 8 bytes: 16 codes, low nibble first */
                    __m128i v = _mm_loadl_epi64((const __m128i*)(c + k / 2));
                    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
                    __m128i both = _mm_unpacklo_epi8(lo, hi);
                    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
                    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(both, both)));
                }
                /* as qtensor.dequantize: code - zero exact, one rounding in the multiply */
                _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(w0, z), s));
                _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(_mm256_sub_ps(w1, z), s));
            }
        }
    }
}

#define QDEQUANT(NAME, KIND)                                                                  \
    void NAME(const uint8_t* codes, int64_t cstride, const float* scales,                   \
              const uint8_t* zeros, int64_t gstride, float* out, int64_t r0, int64_t r1,    \
              int64_t K, int64_t gs) {                                                      \
        dequant_kind(KIND, codes, cstride, scales, zeros, gstride, out, r0, r1, K, gs);     \
    }
QDEQUANT(qdequant_u8, Q_U8)
QDEQUANT(qdequant_u4, Q_U4)
QDEQUANT(qdequant_fp8, Q_FP8)
