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

/* Decode attention: q [B, Hq, D] (bf16 or fp32; tokens q_stride values apart, a token's
   heads packed); k/v pool [S, Hkv, D]; slots [B, kmax]; lens [B]; out [B, Hq, D] (bf16 or
   fp32, packed). Query head h reads KV head h / (Hq / Hkv); D % 8 == 0, D <= 1024. Where
   k_new is given, each request's new key and value row (in the pool's type, heads packed) is
   stored at new_slots[b] first (the decode step's KV write, otherwise a torch call per pool).
   A slot's K (or V) for all heads is one contiguous row, and a page's slots are adjacent, so a
   task takes a request's keys in a chunk of up to 128 with all heads at once: memory is read
   front to back (reading one head's 256-byte piece of every row instead ran at half the
   bandwidth). Requests are split into chunks so that small batches still feed every thread;
   each chunk leaves its softmax max, sum and unnormalised output, merged per request (the
   split-K "flash decoding" merge) by the thread that finishes the request's last chunk, and
   each thread converts the query of the request it attends: the call's threads meet only at
   its end, not at a barrier after the conversion and another after the chunks. Scores: four keys at a time, two query heads per pass
   (one combined horizontal sum). Values: four keys at a time into the chunk's [Hq, D]
   accumulator, which stays in L1. Rows PF_KEYS keys ahead are prefetched by hand.
   bf16 keys and values are read 16 at a time: one 32-byte load, a shift gives the 8 even values
   and a mask the 8 odd ones as fp32 (no widening shuffle: half the conversion work of 8-value
   loads). q and the accumulators are kept in that order (per 16 values: the even, then the
   odd; `perm`), so the dot products and sums are the same; the merge writes out in order.
   q is read and the output written in the model's dtype here, not converted around the call. */
#define PF_KEYS 8
static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T0);
}
static inline void load16_bf16(const uint16_t* p, __m256* even, __m256* odd) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void load16_f32(const float* p, __m256* lo, __m256* hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}
/* Where value s of a head's stored order sits in the head: per 16 (all but a tail of 8), the
   even then the odd where `perm` (bf16 keys), else in order. */
static inline int64_t perm_index(int64_t s, int64_t D, int perm) {
    int64_t base = s & ~(int64_t)15, r = s & 15;
    if (!perm || base + 16 > D) return s;
    return base + (r < 8 ? 2 * r : 2 * (r - 8) + 1);
}

/* A head's accumulator (16 values in the stored order, or the 8 of a tail) plus four keys'
   values weighed by their probabilities w. */
static inline void add_values16(float* acc, const __m256 w[4], const __m256 ve[4],
                                const __m256 vo[4]) {
    __m256 xe = _mm256_loadu_ps(acc), xo = _mm256_loadu_ps(acc + 8);
    for (int j = 0; j < 4; j++) {
        xe = _mm256_fmadd_ps(w[j], ve[j], xe);
        xo = _mm256_fmadd_ps(w[j], vo[j], xo);
    }
    _mm256_storeu_ps(acc, xe);
    _mm256_storeu_ps(acc + 8, xo);
}
static inline void add_values8(float* acc, const __m256 w[4], const __m256 v[4]) {
    __m256 x = _mm256_loadu_ps(acc);
    for (int j = 0; j < 4; j++) x = _mm256_fmadd_ps(w[j], v[j], x);
    _mm256_storeu_ps(acc, x);
}

/* In a chunk function: the pool rows of keys i..i+3 (past n: key i's, which the caller weighs
   0) and of the keys PF_KEYS later (0 past n), and whether those four are adjacent slots (keys
   of one page: one block of 4 rows). Then 1/Hkv of the latter prefetched per head, so the whole
   of them has arrived when the loop reaches them (a burst of whole rows would stall on full
   miss queues). An adjacent block is prefetched front to back, not in the order the loop reads
   it (four rows' head pieces in turn): the memory streams it as it streams one long run
   (measured on a 2-core Zen 3, that read order alone ran at half the bandwidth of a front-to-
   back read of the same bytes). */
#define FOUR_ROWS(POOL, ROWS, AHEAD, BLOCK)                                                   \
    for (int j = 0; j < 4; j++) {                                                           \
        ROWS[j] = POOL + sl[i + j < n ? i + j : i] * row;                                   \
        AHEAD[j] = i + PF_KEYS + j < n ? POOL + sl[i + PF_KEYS + j] * row : 0;              \
    }                                                                                       \
    int BLOCK = AHEAD[3] && AHEAD[3] == AHEAD[0] + 3 * row;
#define PREFETCH_HEAD(AHEAD, BLOCK, hk)                                                       \
    if (BLOCK)                                                                              \
        prefetch_row(AHEAD[0] + (hk) * 4 * D, 4 * D * (int64_t)sizeof(*AHEAD[0]));          \
    else                                                                                    \
        for (int j = 0; j < 4; j++)                                                         \
            if (AHEAD[j]) prefetch_row(AHEAD[j] + (hk) * D, D * (int64_t)sizeof(*AHEAD[j]))

/* LOAD16: 16 keys' values as two fp32 vectors in the stored order; LOAD8: 8 in order (the
   tail of a head); PERM: whether LOAD16 reorders. */
#define ATTN(NAME, KT, LOAD16, LOAD8, PERM)                                                   \
static void NAME##_chunk(const float* qb, const KT* kp, const KT* vp, const int64_t* sl,     \
                         int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale,        \
                         float* sc, float* po) {                                            \
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3, D16 = D & ~15;     \
    float* pm = po + Hq * D;                                                                \
    float* pl = pm + Hq;                                                                    \
    __m128 s4 = _mm_set1_ps(scale);                                                         \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *kr[4], *ahead[4];                                                         \
        FOUR_ROWS(kp, kr, ahead, block);                                                    \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, block, hk);                                                \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0, hb = g0 + 1 < group ? ha + 1 : ha;            \
                const float* qa = qb + ha * D;                                              \
                const float* qw = qb + hb * D;                                              \
                __m256 a[4], b[4];                                                          \
                for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();              \
                for (int64_t d = 0; d < D16; d += 16) {                                     \
                    int64_t o = hk * D + d;                                                 \
                    __m256 xe = _mm256_loadu_ps(qa + d), xo = _mm256_loadu_ps(qa + d + 8);  \
                    __m256 ye = _mm256_loadu_ps(qw + d), yo = _mm256_loadu_ps(qw + d + 8);  \
                    for (int j = 0; j < 4; j++) {                                           \
                        __m256 ke, ko;                                                      \
                        LOAD16(kr[j] + o, &ke, &ko);                                        \
                        a[j] = _mm256_fmadd_ps(ko, xo, _mm256_fmadd_ps(ke, xe, a[j]));      \
                        b[j] = _mm256_fmadd_ps(ko, yo, _mm256_fmadd_ps(ke, ye, b[j]));      \
                    }                                                                       \
                }                                                                           \
                if (D16 < D) {                                                              \
                    int64_t o = hk * D + D16;                                               \
                    __m256 x = _mm256_loadu_ps(qa + D16), y = _mm256_loadu_ps(qw + D16);    \
                    for (int j = 0; j < 4; j++) {                                           \
                        __m256 k8 = LOAD8(kr[j] + o);                                       \
                        a[j] = _mm256_fmadd_ps(k8, x, a[j]);                                \
                        b[j] = _mm256_fmadd_ps(k8, y, b[j]);                                \
                    }                                                                       \
                }                                                                           \
                _mm_storeu_ps(sc + hb * n4 + i, _mm_mul_ps(hsum4(b[0], b[1], b[2], b[3]), s4)); \
                _mm_storeu_ps(sc + ha * n4 + i, _mm_mul_ps(hsum4(a[0], a[1], a[2], a[3]), s4)); \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int64_t h = 0; h < Hq; h++) pl[h] = softmax_partial(sc + h * n4, n, n4, pm + h);   \
    for (int64_t e = 0; e < Hq * D; e += 8) _mm256_storeu_ps(po + e, _mm256_setzero_ps());  \
    for (int64_t i = 0; i < n; i += 4) {                                                    \
        const KT *vr[4], *ahead[4];                                                         \
        FOUR_ROWS(vp, vr, ahead, block);                                                    \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            PREFETCH_HEAD(ahead, block, hk);                                                \
            for (int64_t g0 = 0; g0 < group; g0 += 2) {                                     \
                int64_t ha = hk * group + g0;                                               \
                int two = g0 + 1 < group;                                                   \
                const float* pa = sc + ha * n4 + i;                                         \
                const float* pb = two ? pa + n4 : pa; /* padded keys weigh 0 */             \
                __m256 wa[4], wb[4];                                                        \
                for (int j = 0; j < 4; j++) {                                               \
                    wa[j] = _mm256_set1_ps(pa[j]);                                          \
                    wb[j] = _mm256_set1_ps(pb[j]);                                          \
                }                                                                           \
                float* oa = po + ha * D;                                                    \
                float* ob = two ? oa + D : 0;                                               \
                for (int64_t d = 0; d < D16; d += 16) {                                     \
                    __m256 ve[4], vo[4];                                                    \
                    for (int j = 0; j < 4; j++) LOAD16(vr[j] + hk * D + d, &ve[j], &vo[j]); \
                    add_values16(oa + d, wa, ve, vo);                                       \
                    if (ob) add_values16(ob + d, wb, ve, vo);                               \
                }                                                                           \
                if (D16 < D) {                                                              \
                    __m256 v8[4];                                                           \
                    for (int j = 0; j < 4; j++) v8[j] = LOAD8(vr[j] + hk * D + D16);        \
                    add_values8(oa + D16, wa, v8);                                          \
                    if (ob) add_values8(ob + D16, wb, v8);                                  \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
void NAME(const void* q, int64_t q_stride, int q_bf16, KT* kp, KT* vp,                      \
          const int64_t* slots, const int64_t* lens, int64_t kmax, void* out, int out_bf16, \
          int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale,                       \
          const KT* k_new, int64_t k_stride, const KT* v_new, int64_t v_stride,              \
          const int64_t* new_slots) {                                                       \
    int64_t chunk, T, *first, *owner, row_bytes = Hkv * D * (int64_t)sizeof(KT);            \
    if (k_new) write_new(kp, vp, k_new, k_stride, v_new, v_stride, new_slots, B, row_bytes); \
    float* part = plan_chunks(lens, B, Hq, D, &chunk, &T, &first, &owner);                  \
    int64_t* done = (int64_t*)calloc(B, sizeof(int64_t)); /* chunks attended per request */ \
    int64_t stride = Hq * (D + 2);                                                          \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
        float* sc = (float*)malloc(sizeof(float) * Hq * chunk);                             \
        float* qf = (float*)malloc(sizeof(float) * Hq * D);                                 \
        int64_t held = -1; /* the request whose query qf holds */                           \
        _Pragma("omp for schedule(dynamic) nowait")                                         \
        for (int64_t t = 0; t < T; t++) {                                                   \
            int64_t b = owner[t], c0 = (t - first[b]) * chunk;                              \
            int64_t n = lens[b] - c0 < chunk ? lens[b] - c0 : chunk;                        \
            if (b != held) gather_query(q, b * q_stride, q_bf16, Hq, D, PERM, qf);          \
            held = b;                                                                       \
            NAME##_chunk(qf, kp, vp, slots + b * kmax + c0, n, Hq, Hkv, D, scale, sc,       \
                         part + t * stride);                                                \
            /* The thread that finishes a request's last chunk merges its chunks. */        \
            if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == first[b + 1] - first[b]) \
                merge_request(part, first, b, Hq, D, PERM, out, out_bf16);                  \
        }                                                                                   \
        free(sc); free(qf);                                                                 \
    }                                                                                       \
    free(part); free(first); free(owner); free(done);                                       \
}

/* The step's new keys and values into the pool before they are attended: one row of
   `row_bytes` per request, the requests' rows k_stride (v_stride) bytes apart in k_new (v_new).
   The store needs no call of its own. */
static void write_new(void* kp, void* vp, const void* k_new, int64_t k_stride, const void* v_new,
                      int64_t v_stride, const int64_t* new_slots, int64_t B, int64_t row_bytes) {
    for (int64_t b = 0; b < B; b++) {
        __builtin_memcpy((char*)kp + new_slots[b] * row_bytes, (const char*)k_new + b * k_stride,
                         (size_t)row_bytes);
        __builtin_memcpy((char*)vp + new_slots[b] * row_bytes, (const char*)v_new + b * v_stride,
                         (size_t)row_bytes);
    }
}

/* One head of q (D values) to fp32 in the stored order. */
static inline void gather_head(const void* q, int64_t src, int q_bf16, int64_t D, int perm,
                               float* dst) {
    int64_t s = 0;
    if (q_bf16 && perm)
        for (; s + 16 <= D; s += 16) {
            __m256 e, o;
            load16_bf16((const uint16_t*)q + src + s, &e, &o);
            _mm256_storeu_ps(dst + s, e);
            _mm256_storeu_ps(dst + s + 8, o);
        }
    else if (!perm)
        for (; s + 8 <= D; s += 8)
            _mm256_storeu_ps(dst + s, q_bf16 ? load_bf16((const uint16_t*)q + src + s)
                                             : _mm256_loadu_ps((const float*)q + src + s));
    for (; s < D; s++) {
        int64_t e = src + perm_index(s, D, perm);
        dst[s] = q_bf16 ? bf16_to_f32(((const uint16_t*)q)[e]) : ((const float*)q)[e];
    }
}

/* One request's query (its Hq heads from `src`) to fp32 in the kernel's stored order, by the
   thread about to attend a chunk of that request's keys: a thread's consecutive chunks are
   mostly one request's, so it converts each query about once, and no thread waits at a
   barrier for all of them to be converted (each barrier a decode step crosses is a point where
   a thread another task held up stalls the step). */
static void gather_query(const void* q, int64_t src, int q_bf16, int64_t Hq, int64_t D, int perm,
                         float* qf) {
    for (int64_t h = 0; h < Hq; h++) gather_head(q, src + h * D, q_bf16, D, perm, qf + h * D);
}

/* o (D values in the stored order) times `scale`, written in order at out + base. bf16 from
   the even/odd order: a pair's two rounded values make one 32-bit word (odd high, even low). */
static inline void write_head(const float* o, float scale, int64_t D, int perm, void* out,
                              int64_t base, int out_bf16) {
    __m256 sc = _mm256_set1_ps(scale);
    int64_t s = 0;
    if (out_bf16 && perm)
        for (; s + 16 <= D; s += 16) {
            __m256 e = round8_bf16(_mm256_mul_ps(_mm256_loadu_ps(o + s), sc));
            __m256 d = round8_bf16(_mm256_mul_ps(_mm256_loadu_ps(o + s + 8), sc));
            __m256i pair = _mm256_or_si256(_mm256_castps_si256(d),
                                           _mm256_srli_epi32(_mm256_castps_si256(e), 16));
            _mm256_storeu_si256((__m256i*)((uint16_t*)out + base + s), pair);
        }
    else if (!out_bf16 && !perm)
        for (; s + 8 <= D; s += 8)
            _mm256_storeu_ps((float*)out + base + s, _mm256_mul_ps(_mm256_loadu_ps(o + s), sc));
    for (; s < D; s++) store(out, base + perm_index(s, D, perm), o[s] * scale, out_bf16);
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

/* Request b, per head: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c over its chunks,
   back in the head's order. */
static void merge_request(const float* part, const int64_t* first, int64_t b, int64_t Hq,
                          int64_t D, int perm, void* out, int out_bf16) {
    int64_t stride = Hq * (D + 2), t0 = first[b], t1 = first[b + 1];
    float o[1024]; /* D <= 1024: checked by the caller */
    for (int64_t h = 0; h < Hq; h++) {
        int64_t base = (b * Hq + h) * D;
        if (t1 - t0 == 1) { /* one chunk: its output over its sum */
            const float* p = part + t0 * stride;
            write_head(p + h * D, 1.f / p[Hq * D + Hq + h], D, perm, out, base, out_bf16);
            continue;
        }
        float mx = -INFINITY, total = 0.f;
        for (int64_t t = t0; t < t1; t++) {
            float m = part[t * stride + Hq * D + h];
            mx = m > mx ? m : mx;
        }
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (int64_t t = t0; t < t1; t++) {
            const float* p = part + t * stride;
            float w = expf(p[Hq * D + h] - mx);
            total += w * p[Hq * D + Hq + h];
            __m256 w8 = _mm256_set1_ps(w);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w8, _mm256_loadu_ps(p + h * D + d),
                                                        _mm256_loadu_ps(o + d)));
        }
        write_head(o, 1.f / total, D, perm, out, base, out_bf16);
    }
}

ATTN(decode_attn_bf16, uint16_t, load16_bf16, load_bf16, 1)
ATTN(decode_attn_f32, float, load16_f32, load_f32, 0)
