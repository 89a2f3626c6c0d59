/* Fused elementwise kernels: residual add + RMSNorm (+ rotary), SiLU x up, and the KV cache's
   row store. Each kernel is written once over a vector type of VL fp32 lanes: 16 in the AVX-512
   build, 8 in the AVX2 one. A prefill's rows are many and short (128 values per head), and
   their cost is arithmetic, not memory: mostly the bf16 roundings torch's eager ops imply (the
   q/k norm + rotary rounds each value five times). bf16 data is converted to fp32 with a
   shift (pairs of vectors as even and odd lanes: one op per vector each way), computed in
   fp32 and rounded (to nearest even) wherever torch's eager ops in the model dtype round, so
   results match the PyTorch path bit for bit up to the order of the sum of squares. */
/* No fused multiply-adds but the ones asked for: torch's eager `a * b + c * d` rounds both
   products and the sum, and an fp32 model's results should be those bits. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <string.h>

#include "common.h"
#include "fp8.h"

int64_t norm_parallel_min = INT64_MAX, silu_parallel_min = INT64_MAX;

#define ALWAYS static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VL 16
typedef __m512 vf;
ALWAYS vf v_set1(float a) { return _mm512_set1_ps(a); }
ALWAYS vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
ALWAYS vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
ALWAYS vf v_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS float v_hsum(vf a) { return _mm512_reduce_add_ps(a); }
ALWAYS vf v_load_f32(const float* p) { return _mm512_loadu_ps(p); }
ALWAYS void v_store_f32(float* p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS vf v_load_bf16(const uint16_t* p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
ALWAYS void v_store_bf16(uint16_t* p, vf rounded) { /* the top halves of rounded values */
    __m512i b = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(b));
}
/* 32 bf16 values as two fp32 vectors: the even elements and the odd ones (one load, one
   operation each, against two of each for two runs of 16). Elementwise work does not care
   which lane holds which element as long as every operand is split the same way; st2 puts
   them back. `rounded`: ints whose top halves are the bf16 values (low halves ignored). */
ALWAYS void v_load2_bf16(const uint16_t* p, vf* even, vf* odd) {
    __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
ALWAYS void v_store2_bf16(uint16_t* p, __m512i even, __m512i odd) {
    __m512i hi = _mm512_and_si512(odd, _mm512_set1_epi32((int)0xFFFF0000u));
    _mm512_storeu_si512(p, _mm512_or_si512(hi, _mm512_srli_epi32(even, 16)));
}
/* v's bits + the round-to-nearest-even bias: the top halves are v in bf16 (common.h). */
ALWAYS __m512i v_bias_bf16(vf v) { return bias16_bf16(v); }
ALWAYS __m512i v_bits(vf v) { return _mm512_castps_si512(v); }
ALWAYS vf v_round_bf16(vf v) { /* to the nearest bf16, ties to even, kept as fp32 */
    __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    return _mm512_castsi512_ps(_mm512_and_si512(v_bias_bf16(v), top));
}
ALWAYS vf v_exp(vf x) { return exp16(x); } /* exp8 on 16 lanes (common.h) */
#else
#define VL 8
typedef __m256 vf;
ALWAYS vf v_set1(float a) { return _mm256_set1_ps(a); }
ALWAYS vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ALWAYS vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
ALWAYS vf v_min(vf a, vf b) { return _mm256_min_ps(a, b); }
ALWAYS vf v_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS float v_hsum(vf a) { return hsum(a); }
ALWAYS vf v_load_f32(const float* p) { return _mm256_loadu_ps(p); }
ALWAYS void v_store_f32(float* p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS vf v_load_bf16(const uint16_t* p) { return load_bf16(p); }
ALWAYS vf v_round_bf16(vf v) { return round8_bf16(v); }
ALWAYS void v_store_bf16(uint16_t* p, vf rounded) {
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}
ALWAYS vf v_exp(vf x) { return exp8(x); }
/* As the AVX-512 ones: 16 bf16 values as their even and odd elements. */
ALWAYS void v_load2_bf16(const uint16_t* p, vf* even, vf* odd) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
ALWAYS void v_store2_bf16(uint16_t* p, __m256i even, __m256i odd) {
    /* odd's top words in the odd word slots, even's top words shifted into the even ones */
    __m256i packed = _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA);
    _mm256_storeu_si256((__m256i*)p, packed);
}
ALWAYS __m256i v_bias_bf16(vf v) { return bias8_bf16(v); }
ALWAYS __m256i v_bits(vf v) { return _mm256_castps_si256(v); }
#endif

/* Element i of a bf16 (bf = 1) or fp32 (bf = 0) array, as vectors and as scalars. Every kernel
   below is one always-inlined body called with a constant bf, so each dtype gets its own code
   with the branches on bf folded away. */
ALWAYS vf ld(const void* p, int64_t i, int bf) {
    return bf ? v_load_bf16((const uint16_t*)p + i) : v_load_f32((const float*)p + i);
}
ALWAYS vf rnd(vf v, int bf) { return bf ? v_round_bf16(v) : v; }
ALWAYS void st(void* p, int64_t i, vf rounded, int bf) {
    if (bf) v_store_bf16((uint16_t*)p + i, rounded);
    else v_store_f32((float*)p + i, rounded);
}
ALWAYS float lds(const void* p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
ALWAYS float rnds(float v, int bf) { return bf ? round_bf16(v) : v; }
ALWAYS void sts(void* p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else ((float*)p)[i] = v;
}
ALWAYS const void* at(const void* p, int64_t i, int bf) { return (const char*)p + i * (bf ? 2 : 4); }
ALWAYS void* at_mut(void* p, int64_t i, int bf) { return (char*)p + i * (bf ? 2 : 4); }

/* 2 * VL elements at i as two vectors: bf16 as its even and odd elements, fp32 as its two
   halves. st2 stores such a pair rounded to the dtype (nearest, ties to even); st2r one whose
   values are already of the dtype (no second rounding). */
typedef struct {
    vf a, b;
} vf2;
ALWAYS vf2 ld2(const void* p, int64_t i, int bf) {
    vf2 r;
    if (bf) {
        v_load2_bf16((const uint16_t*)p + i, &r.a, &r.b);
    } else {
        r.a = v_load_f32((const float*)p + i);
        r.b = v_load_f32((const float*)p + i + VL);
    }
    return r;
}
ALWAYS void st2(void* p, int64_t i, vf2 v, int bf) {
    if (bf) {
        v_store2_bf16((uint16_t*)p + i, v_bias_bf16(v.a), v_bias_bf16(v.b));
    } else {
        v_store_f32((float*)p + i, v.a);
        v_store_f32((float*)p + i + VL, v.b);
    }
}
ALWAYS void st2r(void* p, int64_t i, vf2 v, int bf) {
    if (bf) v_store2_bf16((uint16_t*)p + i, v_bits(v.a), v_bits(v.b));
    else st2(p, i, v, bf);
}
ALWAYS vf2 add2(vf2 x, vf2 y) { return (vf2){v_add(x.a, y.a), v_add(x.b, y.b)}; }
ALWAYS vf2 mul2(vf2 x, vf2 y) { return (vf2){v_mul(x.a, y.a), v_mul(x.b, y.b)}; }
ALWAYS vf2 rnd2(vf2 x, int bf) { return (vf2){rnd(x.a, bf), rnd(x.b, bf)}; }

/* The sum of squares of one row of D (two accumulators: a 1024-wide row is a chain of 64 FMAs
   otherwise). With `res`, the row is first x + res, rounded as torch's add, and stored to
   `sum`. */
ALWAYS float row_sumsq(const void* x, const void* res, void* sum, int64_t D, int bf) {
    vf a0 = v_set1(0.f), a1 = v_set1(0.f);
    float ss = 0.f;
    int64_t d = 0;
    for (; d + 2 * VL <= D; d += 2 * VL) {
        vf2 u = ld2(x, d, bf);
        if (res) {
            u = rnd2(add2(u, ld2(res, d, bf)), bf);
            st2r(sum, d, u, bf);
        }
        a0 = v_fmadd(u.a, u.a, a0);
        a1 = v_fmadd(u.b, u.b, a1);
    }
    for (; d + VL <= D; d += VL) {
        vf u = ld(x, d, bf);
        if (res) {
            u = rnd(v_add(u, ld(res, d, bf)), bf);
            st(sum, d, u, bf);
        }
        a0 = v_fmadd(u, u, a0);
    }
    for (; d < D; d++) {
        float v = lds(x, d, bf);
        if (res) {
            v = rnds(v + lds(res, d, bf), bf);
            sts(sum, d, v, bf);
        }
        ss += v * v;
    }
    return ss + v_hsum(v_add(a0, a1));
}

/* w * round(x * inv) (the last rounding left to the caller): torch rounds each of the two
   products (rms_normalize, then the weight). */
ALWAYS vf2 scaled2(const void* x, const void* w, int64_t d, vf inv, int bf) {
    vf2 v = ld2(x, d, bf);
    return mul2(ld2(w, d, bf), rnd2((vf2){v_mul(v.a, inv), v_mul(v.b, inv)}, bf));
}
ALWAYS vf scaled(const void* x, const void* w, int64_t d, vf inv, int bf) {
    return v_mul(ld(w, d, bf), rnd(v_mul(ld(x, d, bf), inv), bf));
}
ALWAYS float scaled_s(const void* x, const void* w, int64_t d, float inv, int bf) {
    return lds(w, d, bf) * rnds(lds(x, d, bf) * inv, bf);
}

ALWAYS void row_scale(const void* x, const void* w, float inv, void* o, int64_t D, int bf) {
    vf vinv = v_set1(inv);
    int64_t d = 0;
    for (; d + 2 * VL <= D; d += 2 * VL) st2(o, d, scaled2(x, w, d, vinv, bf), bf);
    for (; d + VL <= D; d += VL) st(o, d, rnd(scaled(x, w, d, vinv, bf), bf), bf);
    for (; d < D; d++) sts(o, d, scaled_s(x, w, d, inv, bf), bf);
}

/* The normalised row y, then y * cos + roll(y, D / 2) * sin (cos and the signed sin of the
   row's token; rotary.apply_rotary), each product and the sum rounded as torch's: element d
   of the first half pairs with element d of the second, both kept in registers. */
ALWAYS void row_scale_rope(const void* x, const void* w, float inv, const void* c,
                           const void* sn, void* o, int64_t D, int bf) {
    int64_t h = D / 2, d = 0;
    vf vinv = v_set1(inv);
    for (; d + 2 * VL <= h; d += 2 * VL) {
        vf2 ya = rnd2(scaled2(x, w, d, vinv, bf), bf);
        vf2 yb = rnd2(scaled2(x, w, d + h, vinv, bf), bf);
        vf2 lo = add2(rnd2(mul2(ya, ld2(c, d, bf)), bf), rnd2(mul2(yb, ld2(sn, d, bf)), bf));
        vf2 hi = add2(rnd2(mul2(yb, ld2(c, d + h, bf)), bf),
                      rnd2(mul2(ya, ld2(sn, d + h, bf)), bf));
        st2(o, d, lo, bf);
        st2(o, d + h, hi, bf);
    }
    for (; d + VL <= h; d += VL) {
        vf ya = rnd(scaled(x, w, d, vinv, bf), bf), yb = rnd(scaled(x, w, d + h, vinv, bf), bf);
        vf lo = v_add(rnd(v_mul(ya, ld(c, d, bf)), bf), rnd(v_mul(yb, ld(sn, d, bf)), bf));
        vf hi = v_add(rnd(v_mul(yb, ld(c, d + h, bf)), bf),
                      rnd(v_mul(ya, ld(sn, d + h, bf)), bf));
        st(o, d, rnd(lo, bf), bf);
        st(o, d + h, rnd(hi, bf), bf);
    }
    for (; d < h; d++) {
        float ya = rnds(scaled_s(x, w, d, inv, bf), bf);
        float yb = rnds(scaled_s(x, w, d + h, inv, bf), bf);
        sts(o, d, rnds(ya * lds(c, d, bf), bf) + rnds(yb * lds(sn, d, bf), bf), bf);
        sts(o, d + h, rnds(yb * lds(c, d + h, bf), bf) + rnds(ya * lds(sn, d + h, bf), bf), bf);
    }
}

/* RMSNorm over M rows of D. Row i is head i % x_group of token i / x_group (tokens x_stride
   elements apart, a token's heads packed), its weight row i % w_rows. With res_in: the row is
   x + res_in first (stored to res_out, which may be x itself). With cos: the rotary embedding
   after (cos and the signed sin [tokens, D] per token; D even). Output rows packed.
   One parallel region: each thread takes a contiguous run of rows (as schedule(static)) and
   walks its tokens and heads without a division per row. */
ALWAYS void rmsnorm(const void* x, int64_t x_group, int64_t x_stride, const void* res_in,
                    void* res_out, const void* w, int64_t w_rows, void* out, int64_t M,
                    int64_t D, float eps, const void* cos, const void* sin, int bf) {
    #pragma omp parallel if (M * D >= norm_parallel_min)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t i0 = M * tid / nth, i1 = M * (tid + 1) / nth;
        int64_t t = i0 / x_group, hh = i0 % x_group;
        for (int64_t i = i0; i < i1; i++) {
            const void* xr = at(x, t * x_stride + hh * D, bf);
            const void* wr = at(w, (w_rows == 1 ? 0 : i % w_rows) * D, bf);
            void* o = at_mut(out, i * D, bf);
            void* ro = res_in ? at_mut(res_out, i * D, bf) : NULL;
            float ss = row_sumsq(xr, res_in ? at(res_in, i * D, bf) : NULL, ro, D, bf);
            if (ro) xr = ro;
            float inv = 1.f / sqrtf(ss / (float)D + eps);
            if (cos) row_scale_rope(xr, wr, inv, at(cos, t * D, bf), at(sin, t * D, bf), o, D, bf);
            else row_scale(xr, wr, inv, o, D, bf);
            if (++hh == x_group) hh = 0, t++;
        }
    }
}

void rmsnorm_bf16(const uint16_t* x, int64_t x_group, int64_t x_stride, const uint16_t* res_in,
                  uint16_t* res_out, const uint16_t* w, int64_t w_rows, uint16_t* out, int64_t M,
                  int64_t D, float eps, const uint16_t* cos, const uint16_t* sin) {
    rmsnorm(x, x_group, x_stride, res_in, res_out, w, w_rows, out, M, D, eps, cos, sin, 1);
}
void rmsnorm_f32(const float* x, int64_t x_group, int64_t x_stride, const float* res_in,
                 float* res_out, const float* w, int64_t w_rows, float* out, int64_t M,
                 int64_t D, float eps, const float* cos, const float* sin) {
    rmsnorm(x, x_group, x_stride, res_in, res_out, w, w_rows, out, M, D, eps, cos, sin, 0);
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] (a row is gate then up), rounded where torch's
   F.silu(gate) * up rounds in the model dtype: one pass instead of three. */
ALWAYS vf v_silu(vf a) {
    vf e = v_exp(v_min(v_mul(a, v_set1(-1.f)), v_set1(88.f)));
    return v_div(a, v_add(v_set1(1.f), e));
}
ALWAYS void silu_mul(const void* x, void* out, int64_t M, int64_t I, int bf) {
    #pragma omp parallel for schedule(static) if (M * I >= silu_parallel_min)
    for (int64_t t = 0; t < M; t++) {
        const void* g = at(x, t * 2 * I, bf);
        const void* u = at(g, I, bf);
        void* o = at_mut(out, t * I, bf);
        int64_t i = 0;
        for (; i + 2 * VL <= I; i += 2 * VL) {
            vf2 a = ld2(g, i, bf);
            st2(o, i, mul2(rnd2((vf2){v_silu(a.a), v_silu(a.b)}, bf), ld2(u, i, bf)), bf);
        }
        for (; i + VL <= I; i += VL)
            st(o, i, rnd(v_mul(rnd(v_silu(ld(g, i, bf)), bf), ld(u, i, bf)), bf), bf);
        for (; i < I; i++) {
            float a = lds(g, i, bf);
            sts(o, i, rnds(a / (1.f + expf(-a)), bf) * lds(u, i, bf), bf);
        }
    }
}
void silu_mul_f32(const float* x, float* out, int64_t M, int64_t I) { silu_mul(x, out, M, I, 0); }
void silu_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I) {
    silu_mul(x, out, M, I, 1);
}

/* The KV cache's store of a step's new rows: k_pool[slots[t]] = k row t, the same for v (rows
   of row_bytes, source tokens k_stride / v_stride bytes apart: views of the fused qkv output,
   copied where they lie). torch's index_copy_ from such strided views runs element by element.
   Returns the first t whose slot is outside [0, num_slots) and stores nothing then; -1 when
   all are stored. Splits over the threads from KV_SPLIT_BYTES (a decode step's few rows: one
   thread; copies run ~10 GB/s a thread, so 256 KB is ~25 us against a few us of wake-up). */
#define KV_SPLIT_BYTES (1 << 18)
int64_t kv_store(char* k_pool, char* v_pool, int64_t num_slots, const int64_t* slots,
                 const char* k, int64_t k_stride, const char* v, int64_t v_stride, int64_t T,
                 int64_t row_bytes) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return t;
    #pragma omp parallel for schedule(static) if (2 * T * row_bytes >= KV_SPLIT_BYTES)
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_pool + slots[t] * row_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_pool + slots[t] * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
    return -1;
}

/* kv_store for an fp8 pool (--kv-cache-dtype fp8): the rows (row values each, bf16 or fp32 as
   src_bf16 says) rounded to e4m3 as they are stored (fp8.h); k_back and v_back (T x row
   values in the rows' dtype, or NULL): the values stored, which attention over this step's own
   rows reads (as every later step reads them from the pool). */
int64_t kv_store_e4m3(uint8_t* k_pool, uint8_t* v_pool, int64_t num_slots, const int64_t* slots,
                      const char* k, int64_t k_stride, const char* v, int64_t v_stride, int64_t T,
                      int64_t row, int src_bf16, char* k_back, char* v_back) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return t;
    int64_t size = src_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (2 * T * row * size >= KV_SPLIT_BYTES)
    for (int64_t t = 0; t < T; t++) {
        e4m3_row(k + t * k_stride, src_bf16, row, k_pool + slots[t] * row,
                 k_back ? k_back + t * row * size : 0);
        e4m3_row(v + t * v_stride, src_bf16, row, v_pool + slots[t] * row,
                 v_back ? v_back + t * row * size : 0);
    }
    return -1;
}
