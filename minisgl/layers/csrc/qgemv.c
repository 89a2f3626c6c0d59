/* GEMV over quantized weights (minisgl/quant/qtensor.py's layout), for decode-sized inputs:
   each weight byte is read once per call and turned into fp32 in registers, never into a
   dequantized copy of the weight.

     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k] - zero[n, g] * xsum[m, g])

   xsum[m, g] (x summed over group g) comes from the caller; it is the same for every output
   row, so the zero point costs one multiply per group instead of one subtract per weight.
   Groups are contiguous runs of `gs` input features (gs % 8 == 0, K % gs == 0 or gs == K).

   Codes: 4-bit (two per byte, the even input feature in the low nibble), 8-bit unsigned, or
   fp8 e4m3 (no zero points), each widened to 8 fp32 lanes with a few integer ops. */
#include "common.h"

static inline __m256 codes_u4(const uint8_t* p) { /* 4 bytes -> 8 values, low nibble first */
    uint32_t u;
    __builtin_memcpy(&u, p, 4);
    __m128i v = _mm_cvtsi32_si128((int)u);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

static inline __m256 codes_u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* 8 e4m3 bytes -> their fp32 values: exponent and mantissa shifted into place, the bias
   difference (127 - 7) added to the exponent; exponent 0 (subnormal) is mantissa * 2^-9. */
static inline __m256 codes_fp8(const uint8_t* p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(mag, _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))),
                               _mm256_set1_ps(0.001953125f));
    __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)),
                                        _mm256_setzero_si256());
    __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

#define MAX_M 16

#define QGEMV(NAME, CODES, BYTES_PER_8, HAS_ZERO)                                             \
void NAME(const float* x, const float* xsum, const uint8_t* codes, const float* scales,      \
          const uint8_t* zeros, float* y, int64_t M, int64_t N, int64_t K, int64_t gs) {      \
    int64_t G = K / gs, row_bytes = K / 8 * (BYTES_PER_8);                                  \
    _Pragma("omp parallel for schedule(static)")                                            \
    for (int64_t n = 0; n < N; n++) {                                                       \
        const uint8_t* c = codes + n * row_bytes;                                           \
        if (M == 1) { /* batch 1: the accumulators stay in registers */                     \
            __m256 total = _mm256_setzero_ps();                                             \
            float zero_part = 0;                                                            \
            for (int64_t g = 0; g < G; g++) {                                               \
                __m256 acc = _mm256_setzero_ps(), acc2 = acc; /* two FMA chains */          \
                int64_t k = g * gs, end = (g + 1) * gs;                                     \
                for (; k + 16 <= end; k += 16) {                                            \
                    acc = _mm256_fmadd_ps(CODES(c + k / 8 * (BYTES_PER_8)),                 \
                                          _mm256_loadu_ps(x + k), acc);                     \
                    acc2 = _mm256_fmadd_ps(CODES(c + (k + 8) / 8 * (BYTES_PER_8)),          \
                                           _mm256_loadu_ps(x + k + 8), acc2);               \
                }                                                                           \
                if (k < end)                                                                \
                    acc = _mm256_fmadd_ps(CODES(c + k / 8 * (BYTES_PER_8)),                 \
                                          _mm256_loadu_ps(x + k), acc);                     \
                acc = _mm256_add_ps(acc, acc2);                                             \
                float s = scales[n * G + g];                                                \
                total = _mm256_fmadd_ps(acc, _mm256_set1_ps(s), total);                     \
                if (HAS_ZERO) zero_part += s * (float)zeros[n * G + g] * xsum[g];           \
            }                                                                               \
            y[n] = hsum(total) - zero_part;                                                 \
            continue;                                                                       \
        }                                                                                   \
        __m256 total[MAX_M];                                                                \
        float zero_part[MAX_M] = {0};                                                       \
        for (int64_t m = 0; m < M; m++) total[m] = _mm256_setzero_ps();                     \
        for (int64_t g = 0; g < G; g++) {                                                   \
            __m256 acc[MAX_M];                                                              \
            for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();                   \
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {                            \
                __m256 w = CODES(c + k / 8 * (BYTES_PER_8));                                \
                for (int64_t m = 0; m < M; m++)                                             \
                    acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k), acc[m]);    \
            }                                                                               \
            float s = scales[n * G + g];                                                    \
            __m256 sv = _mm256_set1_ps(s);                                                  \
            /* the group's scale applied lane-wise: one horizontal sum per row, at the end */ \
            for (int64_t m = 0; m < M; m++) total[m] = _mm256_fmadd_ps(acc[m], sv, total[m]); \
            if (HAS_ZERO) {                                                                 \
                float sz = s * (float)zeros[n * G + g];                                     \
                for (int64_t m = 0; m < M; m++) zero_part[m] += sz * xsum[m * G + g];       \
            }                                                                               \
        }                                                                                   \
        for (int64_t m = 0; m < M; m++) y[m * N + n] = hsum(total[m]) - zero_part[m];       \
    }                                                                                       \
}

QGEMV(qgemv_u4, codes_u4, 4, 1)
QGEMV(qgemv_u8, codes_u8, 8, 1)
QGEMV(qgemv_fp8, codes_fp8, 8, 0)
