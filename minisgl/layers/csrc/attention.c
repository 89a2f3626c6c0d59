#include "common.h"

/* Turn raw scores s[0..n) into exp(s - max) in place, zero s[n..n4); *mx = max; returns
   the sum. */
static float softmax_partial(float* s, int64_t n, int64_t n4, float* mx_out) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 m8 = _mm256_set1_ps(mx), tot8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
        _mm256_storeu_ps(s + i, e);
        tot8 = _mm256_add_ps(tot8, e);
    }
    float total = hsum(tot8);
    for (; i < n; i++) { s[i] = expf(s[i] - mx); total += s[i]; }
    for (; i < n4; i++) s[i] = 0.f;
    *mx_out = mx;
    return total;
}

/* Decode attention: q [B, Hq, D] fp32; k/v pool [S, Hkv, D]; slots [B, kmax]; lens [B];
   out [B, Hq, D] fp32. Query head h reads KV head h / (Hq / Hkv); D % 8 == 0.
   A slot's K (or V) for all heads is one contiguous row, and a page's slots are adjacent, so a
   task takes a request's keys in a chunk of up to 128 with all heads at once: memory is read
   front to back (reading one head's 256-byte piece of every row instead ran at half the
   bandwidth). Requests are split into chunks so that small batches still feed every thread;
   each chunk leaves its softmax max, sum and unnormalised output, merged per request at the end
   (the split-K "flash decoding" merge). Scores: four keys at a time, two query heads per pass
   (one combined horizontal sum). Values: four keys at a time into the chunk's [Hq, D]
   accumulator, which stays in L1. Rows PF_KEYS keys ahead are prefetched by hand. */
#define PF_KEYS 8
static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T0);
}

/* In a chunk function: the pool rows of keys i..i+3 (past n: key i's, which the caller weighs
   0) and of the keys PF_KEYS later (0 past n); then head hk's piece of the latter prefetched,
   one head at a time (a burst of whole rows would stall on full miss queues). */
#define FOUR_ROWS(POOL, ROWS, AHEAD)                                                          \
    for (int j = 0; j < 4; j++) {                                                           \
        ROWS[j] = POOL + sl[i + j < n ? i + j : i] * row;                                   \
        AHEAD[j] = i + PF_KEYS + j < n ? POOL + sl[i + PF_KEYS + j] * row : 0;              \
    }
#define PREFETCH_HEAD(AHEAD, hk)                                                              \
    for (int j = 0; j < 4; j++)                                                             \
        if (AHEAD[j]) prefetch_row(AHEAD[j] + (hk) * D, D * (int64_t)sizeof(*AHEAD[j]))

#define ATTN(NAME, KT, LOAD)                                                                  \
static void NAME##_chunk(const float* qb, const KT* kp, const KT* vp, const int64_t* sl,     \
                         int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale,        \
                         float* sc, float* po) {                                            \
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;                    \
    float* pm = po + Hq * D;                                                                \
    float* pl = pm + Hq;                                                                    \
    __m128 s4 = _mm_set1_ps(scale);                                                         \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *kr[4], *ahead[4];                                                         \
        FOUR_ROWS(kp, kr, ahead);                                                          \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, hk);                                                       \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0, hb = g0 + 1 < group ? ha + 1 : ha;            \
                const float* qa = qb + ha * D;                                              \
                const float* qw = qb + hb * D;                                              \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                  \
                for (int64_t d = 0; d < D; d += 8) {                                        \
                    int64_t o = hk * D + d;                                                 \
                    __m256 x = _mm256_loadu_ps(qa + d), y = _mm256_loadu_ps(qw + d);        \
                    __m256 k0 = LOAD(kr[0] + o), k1 = LOAD(kr[1] + o);                      \
                    __m256 k2 = LOAD(kr[2] + o), k3 = LOAD(kr[3] + o);                      \
                    a0 = _mm256_fmadd_ps(k0, x, a0); b0 = _mm256_fmadd_ps(k0, y, b0);       \
                    a1 = _mm256_fmadd_ps(k1, x, a1); b1 = _mm256_fmadd_ps(k1, y, b1);       \
                    a2 = _mm256_fmadd_ps(k2, x, a2); b2 = _mm256_fmadd_ps(k2, y, b2);       \
                    a3 = _mm256_fmadd_ps(k3, x, a3); b3 = _mm256_fmadd_ps(k3, y, b3);       \
                }                                                                           \
                _mm_storeu_ps(sc + hb * n4 + i, _mm_mul_ps(hsum4(b0, b1, b2, b3), s4));     \
                _mm_storeu_ps(sc + ha * n4 + i, _mm_mul_ps(hsum4(a0, a1, a2, a3), s4));     \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int64_t h = 0; h < Hq; h++) pl[h] = softmax_partial(sc + h * n4, n, n4, pm + h);   \
    for (int64_t e = 0; e < Hq * D; e += 8) _mm256_storeu_ps(po + e, _mm256_setzero_ps());  \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *vr[4], *ahead[4];                                                         \
        FOUR_ROWS(vp, vr, ahead);                                                          \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, hk);                                                       \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0;                                               \
                int two = g0 + 1 < group;                                                   \
                const float* pa = sc + ha * n4 + i;                                         \
                const float* pb = two ? pa + n4 : pa; /* padded keys weigh 0 */             \
                __m256 wa0 = _mm256_set1_ps(pa[0]), wa1 = _mm256_set1_ps(pa[1]);            \
                __m256 wa2 = _mm256_set1_ps(pa[2]), wa3 = _mm256_set1_ps(pa[3]);            \
                __m256 wb0 = _mm256_set1_ps(pb[0]), wb1 = _mm256_set1_ps(pb[1]);            \
                __m256 wb2 = _mm256_set1_ps(pb[2]), wb3 = _mm256_set1_ps(pb[3]);            \
                float* oa = po + ha * D;                                                    \
                float* ob = two ? oa + D : 0;                                               \
                for (int64_t d = 0; d < D; d += 8) {                                        \
                    int64_t o = hk * D + d;                                                 \
                    __m256 v0 = LOAD(vr[0] + o), v1 = LOAD(vr[1] + o);                      \
                    __m256 v2 = LOAD(vr[2] + o), v3 = LOAD(vr[3] + o);                      \
                    __m256 x = _mm256_loadu_ps(oa + d);                                     \
                    x = _mm256_fmadd_ps(wa0, v0, x); x = _mm256_fmadd_ps(wa1, v1, x);       \
                    x = _mm256_fmadd_ps(wa2, v2, x); x = _mm256_fmadd_ps(wa3, v3, x);       \
                    _mm256_storeu_ps(oa + d, x);                                            \
                    if (ob) {                                                               \
                        __m256 y = _mm256_loadu_ps(ob + d);                                 \
                        y = _mm256_fmadd_ps(wb0, v0, y); y = _mm256_fmadd_ps(wb1, v1, y);   \
                        y = _mm256_fmadd_ps(wb2, v2, y); y = _mm256_fmadd_ps(wb3, v3, y);   \
                        _mm256_storeu_ps(ob + d, y);                                        \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
void NAME(const float* q, const KT* kp, const KT* vp, const int64_t* slots,                  \
          const int64_t* lens, int64_t kmax, float* out, int64_t B, int64_t Hq,             \
          int64_t Hkv, int64_t D, float scale) {                                            \
    int64_t chunk, T, *first, *owner;                                                       \
    float* part = plan_chunks(lens, B, Hq, D, &chunk, &T, &first, &owner);                  \
    int64_t stride = Hq * (D + 2);                                                          \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
        float* sc = (float*)malloc(sizeof(float) * Hq * chunk);                             \
        _Pragma("omp for schedule(dynamic)")                                                \
        for (int64_t t = 0; t < T; t++) {                                                   \
            int64_t b = owner[t], c0 = (t - first[b]) * chunk;                              \
            int64_t n = lens[b] - c0 < chunk ? lens[b] - c0 : chunk;                        \
            NAME##_chunk(q + b * Hq * D, kp, vp, slots + b * kmax + c0, n, Hq, Hkv, D,      \
                         scale, sc, part + t * stride);                                     \
        }                                                                                   \
        free(sc);                                                                           \
        merge_chunks(part, first, B, Hq, D, out);                                           \
    }                                                                                       \
    free(part); free(first); free(owner);                                                   \
}

/* Chunk length (a multiple of 4, 16..128: enough tasks for every thread, few merges), the
   chunks' first index per request, each chunk's request, and the chunks' partial results. */
static float* plan_chunks(const int64_t* lens, int64_t B, int64_t Hq, int64_t D,
                          int64_t* chunk, int64_t* T, int64_t** first, int64_t** owner) {
    int64_t total = 0, threads = omp_get_max_threads();
    for (int64_t b = 0; b < B; b++) total += lens[b];
    int64_t c = (total + 4 * threads - 1) / (4 * threads);
    c = c < 16 ? 16 : (c > 128 ? 128 : c);
    *chunk = c = (c + 3) & ~(int64_t)3;
    *first = (int64_t*)malloc(sizeof(int64_t) * (B + 1));
    (*first)[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lens[b] > 0 ? lens[b] : 1;
        (*first)[b + 1] = (*first)[b] + (n + c - 1) / c;
    }
    *T = (*first)[B];
    *owner = (int64_t*)malloc(sizeof(int64_t) * *T);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = (*first)[b]; t < (*first)[b + 1]; t++) (*owner)[t] = b;
    return (float*)malloc(sizeof(float) * *T * Hq * (D + 2));
}

/* Per request and head: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c (inside a parallel
   region: the requests are shared among its threads). */
static void merge_chunks(const float* part, const int64_t* first, int64_t B, int64_t Hq,
                         int64_t D, float* out) {
    int64_t stride = Hq * (D + 2);
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hq; h++) {
            float mx = -INFINITY, total = 0.f;
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                float m = part[t * stride + Hq * D + h];
                mx = m > mx ? m : mx;
            }
            float* o = out + (b * Hq + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                const float* p = part + t * stride;
                float w = expf(p[Hq * D + h] - mx);
                total += w * p[Hq * D + Hq + h];
                for (int64_t d = 0; d < D; d++) o[d] += w * p[h * D + d];
            }
            float inv = 1.f / total;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

ATTN(decode_attn_bf16, uint16_t, load_bf16)
ATTN(decode_attn_f32, float, load_f32)
