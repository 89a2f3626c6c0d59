/* Fused elementwise kernels: residual add + RMSNorm (+ rotary), SiLU x up. */
#include "common.h"

int64_t norm_parallel_min = INT64_MAX, silu_parallel_min = INT64_MAX;

static inline void store8_bf16(uint16_t* p, __m256 rounded) {
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

/* RMSNorm over rows of D (row i of x: token i / x_group at x_stride apart, head i % x_group),
   weight row (i % w_rows), with an optional residual add first (res_out = x + res_in,
   normalising that) and an optional rotary embedding after (cos and the signed sin of the
   row's token, [tokens, D]: out = y * cos + roll(y, D / 2) * sin, as rotary.apply_rotary).
   Rounds where torch's eager ops in the model dtype round, so results match the PyTorch path
   (up to the order of the sum of squares). 8 lanes at a time, a scalar tail for D % 8. */
static inline __m256 id8(__m256 v) { return v; }
static inline void store8_f32(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

#define RMSNORM(NAME, T, TO_F, ROUND, FROM_F, LOAD8, ROUND8, STORE8)                          \
void NAME(const T* x, int64_t x_group, int64_t x_stride, const T* res_in, T* res_out,       \
          const T* w,                                                                       \
          int64_t w_rows, T* out, int64_t M, int64_t D, float eps, const T* cos,            \
          const T* sin) {                                                                   \
    int64_t D8 = D / 8 * 8;                                                                 \
    _Pragma("omp parallel for schedule(static) if (M * D >= norm_parallel_min)")            \
    for (int64_t i = 0; i < M; i++) {                                                       \
        const T* xr = x + (i / x_group) * x_stride + (i % x_group) * D;                     \
        const T* wr = w + (i % w_rows) * D;                                                 \
        T* o = out + i * D;                                                                 \
        __m256 acc = _mm256_setzero_ps();                                                   \
        float ss = 0.f;                                                                     \
        int64_t d;                                                                          \
        if (res_in) {                                                                       \
            const T* ri = res_in + i * D;                                                   \
            T* ro = res_out + i * D;                                                        \
            for (d = 0; d < D8; d += 8) {                                                   \
                __m256 v = ROUND8(_mm256_add_ps(LOAD8(xr + d), LOAD8(ri + d)));             \
                STORE8(ro + d, v);                                                          \
                acc = _mm256_fmadd_ps(v, v, acc);                                           \
            }                                                                               \
            for (; d < D; d++) {                                                            \
                float v = ROUND(TO_F(xr[d]) + TO_F(ri[d]));                                 \
                ro[d] = FROM_F(v);                                                          \
                ss += v * v;                                                                \
            }                                                                               \
            xr = ro;                                                                        \
        } else {                                                                            \
            for (d = 0; d < D8; d += 8) {                                                   \
                __m256 v = LOAD8(xr + d);                                                   \
                acc = _mm256_fmadd_ps(v, v, acc);                                           \
            }                                                                               \
            for (; d < D; d++) { float v = TO_F(xr[d]); ss += v * v; }                      \
        }                                                                                   \
        float inv = 1.f / sqrtf((ss + hsum(acc)) / (float)D + eps);                         \
        __m256 vinv = _mm256_set1_ps(inv);                                                  \
        /* y = w * normalised x, rounded as torch rounds each of the two products */        \
        T* y = o;                                                                           \
        T buf[512]; /* D <= 512 with rotary, checked by the caller */                       \
        if (cos) y = buf;                                                                   \
        for (d = 0; d < D8; d += 8)                                                         \
            STORE8(y + d, ROUND8(_mm256_mul_ps(LOAD8(wr + d),                               \
                                               ROUND8(_mm256_mul_ps(LOAD8(xr + d), vinv))))); \
        for (; d < D; d++) y[d] = FROM_F(ROUND(TO_F(wr[d]) * ROUND(TO_F(xr[d]) * inv)));    \
        if (!cos) continue;                                                                 \
        const T* c = cos + (i / x_group) * D;                                               \
        const T* sn = sin + (i / x_group) * D;                                              \
        int64_t h = D / 2;                                                                  \
        if (h % 8 == 0) {                                                                   \
            for (d = 0; d < D; d += 8) {                                                    \
                __m256 a = ROUND8(_mm256_mul_ps(LOAD8(y + d), LOAD8(c + d)));               \
                __m256 b = ROUND8(_mm256_mul_ps(LOAD8(y + (d < h ? d + h : d - h)),         \
                                                LOAD8(sn + d)));                            \
                STORE8(o + d, ROUND8(_mm256_add_ps(a, b)));                                 \
            }                                                                               \
        } else {                                                                            \
            for (d = 0; d < D; d++)                                                         \
                o[d] = FROM_F(ROUND(ROUND(TO_F(y[d]) * TO_F(c[d])) +                        \
                                    ROUND(TO_F(y[d < h ? d + h : d - h]) * TO_F(sn[d]))));  \
        }                                                                                   \
    }                                                                                       \
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] (a row is gate then up), rounded where torch's
   F.silu(gate) * up rounds in the model dtype; one pass instead of three, on 8 lanes. */
static inline __m256 silu8(__m256 a) {
    __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), _mm256_set1_ps(88.f)));
    return _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
void silu_mul_f32(const float* x, float* out, int64_t M, int64_t I) {
    #pragma omp parallel for schedule(static) if (M * I >= silu_parallel_min)
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
    #pragma omp parallel for schedule(static) if (M * I >= silu_parallel_min)
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

RMSNORM(rmsnorm_bf16, uint16_t, bf16_to_f32, round_bf16, f32_to_bf16, load_bf16, round8_bf16,
        store8_bf16)
RMSNORM(rmsnorm_f32, float, id_f32, id_f32, id_f32, load_f32, id8, store8_f32)
