/* fp8 e4m3 codes, both ways. Widening (fp8 weights' and the KV cache's reads): a code's value
   times 2^-8 in registers, exactly. Rounding (the KV cache's stores: --kv-cache-dtype fp8;
   kv_pool.to_fp8): each value to the nearest e4m3, ties to even, its magnitude clamped to 448
   (e4m3's largest), no scale: the bits torch's clamp then cast to float8_e4m3fn give. */
#pragma once
#include "common.h"

/* 8 e4m3 codes (the low 8 bytes of v) -> their values times 2^-8 as fp32: each code moved to
   the high byte of a 16-bit lane and down one bit, its sign restored to bit 15, reads as an
   fp16 of the same mantissa whose exponent is 8 less (e4m3's bias 7, fp16's 15; subnormals map
   to subnormals); F16C widens it exactly. */
static inline __m256 e4m3x8_low(__m128i v) {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), v);
    h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

#if defined(__AVX512F__)
/* The same for 16 codes at p. */
static inline __m512 e4m3x16_low(const uint8_t* p) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
    h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(h);
}
#endif

/* One value (scalar: the tails). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (!(a < 448.f)) return sign | 0x7E;
    if (a < 0.015625f) /* below the least normal, 2^-6: multiples of 2^-9 (8 of them is 2^-6) */
        return sign | (uint8_t)nearbyintf(a * 512.f);
    __builtin_memcpy(&u, &a, 4);
    u += 0x7FFFF + ((u >> 20) & 1); /* the 23-bit mantissa rounded to 3 bits, ties to even */
    uint32_t e = (u >> 23) - 120, m = (u >> 20) & 7; /* exponent bias 127 -> 7 */
    return sign | (uint8_t)(e << 3 | m); /* a < 448 rounds to 448 (e 15, m 6) at most */
}

/* 8 values: their codes in the low byte of each 32-bit lane, and `back` the values the codes
   hold (what attention reads back from the cache). */
static inline __m256i e4m3_round8(__m256 x, __m256* back) {
    const __m256 neg0 = _mm256_set1_ps(-0.f);
    __m256 sign = _mm256_and_ps(x, neg0);
    __m256 a = _mm256_min_ps(_mm256_andnot_ps(neg0, x), _mm256_set1_ps(448.f)); /* NaN: 448 */
    __m256i u = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFFF)));
    __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    __m256 kept = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFF00000u)));
    /* below 2^-6: multiples of 2^-9 */
    __m256 m = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    code = _mm256_blendv_epi8(code, _mm256_cvtps_epi32(m), _mm256_castps_si256(small));
    kept = _mm256_blendv_ps(kept, _mm256_mul_ps(m, _mm256_set1_ps(1.f / 512.f)), small);
    *back = _mm256_or_ps(kept, sign);
    return _mm256_or_si256(code, _mm256_srli_epi32(_mm256_castps_si256(sign), 24));
}

/* The value a code holds. */
static inline float e4m3_to_f32(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float a = e ? ldexpf(1.f + m / 8.f, e - 7) : m / 512.f;
    return c & 0x80 ? -a : a;
}

/* n values of src (bf16 or fp32) rounded into dst; back (src's dtype, or NULL): the values the
   codes hold (in bf16 exactly: a code's value has 4 significant bits). */
static inline void e4m3_row(const void* src, int src_bf16, int64_t n, uint8_t* dst, void* back) {
    const uint16_t* sh = (const uint16_t*)src;
    const float* sf = (const float*)src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 kept;
        __m256i c = e4m3_round8(src_bf16 ? load_bf16(sh + i) : _mm256_loadu_ps(sf + i), &kept);
        __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
        __m128i c16 = _mm_packus_epi32(lo, hi);
        _mm_storel_epi64((__m128i*)(dst + i), _mm_packus_epi16(c16, c16));
        if (back && src_bf16) {
            __m256i h = _mm256_srli_epi32(_mm256_castps_si256(kept), 16);
            lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
            _mm_storeu_si128((__m128i*)((uint16_t*)back + i), _mm_packus_epi32(lo, hi));
        } else if (back) {
            _mm256_storeu_ps((float*)back + i, kept);
        }
    }
    for (; i < n; i++) {
        dst[i] = f32_to_e4m3(src_bf16 ? bf16_to_f32(sh[i]) : sf[i]);
        if (back && src_bf16)
            ((uint16_t*)back)[i] = f32_to_bf16(e4m3_to_f32(dst[i]));
        else if (back)
            ((float*)back)[i] = e4m3_to_f32(dst[i]);
    }
}
