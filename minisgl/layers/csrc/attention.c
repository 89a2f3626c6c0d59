#include "common.h"
#include "fp8.h"

/* The largest of 8 lanes (none NaN: as the loop that fills them, NaN lanes keep -inf). */
static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Turn raw scores s[0..n) into exp(s - max) in place, zero s[n..n4); *mx = max; returns
   the sum. */
static float softmax_partial(float* s, int64_t n, int64_t n4, float* mx_out) {
    /* The max 8 lanes at a time: max is exact in any order, and _mm256_max_ps(s, m) keeps m
       where s is NaN, as the scalar s > m ? s : m does. */
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(s + i), m8);
    float mx = hmax(m8);
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 tot8 = _mm256_setzero_ps();
    m8 = _mm256_set1_ps(mx);
    i = 0;
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
static inline void load16_bf16(const uint16_t* p, __m256* even, __m256* odd) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void load16_f32(const float* p, __m256* lo, __m256* hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}
/* fp8 e4m3 pools (--kv-cache-dtype fp8): 8 codes (the low 8 bytes of b) as fp32 in order. */
static inline __m256 e4m3x8(__m128i b) {
    return _mm256_mul_ps(e4m3x8_low(b), _mm256_set1_ps(256.f)); /* 256: exact, a power of two */
}
static inline void load16_e4m3(const uint8_t* p, __m256* lo, __m256* hi) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    *lo = e4m3x8(b);
    *hi = e4m3x8(_mm_srli_si128(b, 8));
}
static inline __m256 load8_e4m3(const uint8_t* p) {
    return e4m3x8(_mm_loadl_epi64((const __m128i*)p));
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

/* In a chunk function's values' pass: the pool rows of keys i..i+3 (past n: key i's, which the
   caller weighs 0) and of the keys PF_KEYS later (past n: the first keys' rows of the task the
   thread likely takes next, nsl[0..nn), else 0), and whether those four are adjacent slots (keys
   of one page: one block of 4 rows). Then 1/Hkv of the latter prefetched per head (HEAD_LINES),
   so the whole of them has arrived when the loop reaches them (a burst of whole rows would
   stall on full miss queues). An adjacent block is prefetched front to back, not in the order
   the loop reads it (four rows' head pieces in turn): the memory streams it as it streams one
   long run (measured on a 2-core Zen 3, that read order alone ran at half the bandwidth of a
   front-to-back read of the same bytes). */
#define FOUR_VALUE_ROWS(ROWS, AHEAD, BLOCK)                                                   \
    for (int j = 0; j < 4; j++) {                                                           \
        int64_t a_ = i + PF_KEYS + j;                                                       \
        ROWS[j] = vp + sl[i + j < n ? i + j : i] * row;                                     \
        AHEAD[j] = a_ < n ? vp + sl[a_] * row : (a_ - n < nn ? kp + nsl[a_ - n] * row : 0); \
    }                                                                                       \
    int BLOCK = AHEAD[3] && AHEAD[3] == AHEAD[0] + 3 * row;
/* The same for the keys' pass, whose prefetch runs on past the chunk's last key into its first
   values' rows: the values' pass that follows starts on rows already on their way, not on a
   cold miss per row until its own prefetch is PF_KEYS keys ahead. */
#define FOUR_KEY_ROWS(ROWS, AHEAD, BLOCK)                                                     \
    for (int j = 0; j < 4; j++) {                                                           \
        int64_t a_ = i + PF_KEYS + j;                                                       \
        ROWS[j] = kp + sl[i + j < n ? i + j : i] * row;                                     \
        AHEAD[j] = a_ < n ? kp + sl[a_] * row : (a_ - n < n ? vp + sl[a_ - n] * row : 0);   \
    }                                                                                       \
    int BLOCK = AHEAD[3] && AHEAD[3] == AHEAD[0] + 3 * row;
/* Head hk's share of the rows ahead as four runs PFL[j] of D values (0: none): of an adjacent
   block its hk-th 1/Hkv, front to back; else each row's head hk. A pass prefetches a run's
   lines one beside each of its loads of key j (16-lane passes: line d / 32 beside values
   [d, d + 32); 8-lane: LINE_AT) instead of all in a burst: on the Xeon of docs/performance.md
   (KVM, AMX; 32 requests x 65 keys, 28 layers, cold) a burst per head stalled the core at the
   prefetch instructions (perf: 44% of the keys' pass samples on one of them): the 16-lane call
   read 17.9 GB/s, spread 19.4-20.6 (1 thread 9.0 -> 10.2); the AVX2 build's 8-lane passes
   16.4 -> 13.0 ms, fp32 pools 24.6 -> 21.2. Into L2, not L1: a core holds few more L1 misses
   in flight than a 2 KB row has lines, so prefetches into L1 capped a core at ~10 GB/s; into
   L2 (which holds several times more) the call ran 1.35-1.5x faster (64 requests x 320 keys
   on shuffled pages, Qwen3-0.6B heads, AMD EPYC Zen 4, 1 and 2 threads, cold, interleaved; 4
   or 16 keys ahead measured the same). */
#define HEAD_LINES(PFL, AHEAD, BLOCK, hk)                                                     \
    const char* PFL[4];                                                                     \
    for (int j = 0; j < 4; j++)                                                             \
        PFL[j] = BLOCK ? (const char*)(AHEAD[0] + (hk) * 4 * D) + j * D * sizeof(*AHEAD[0])  \
                       : (AHEAD[j] ? (const char*)(AHEAD[j] + (hk) * D) : 0)
/* The 8-lane passes' part of that: the line at byte d * SIZE of run j, beside key j's load of
   values [d, d + 16) that starts it (and beside the tail's load). */
#define LINE_AT(PFL, j, d, SIZE)                                                              \
    if (g0 == 0 && PFL[j] && ((d) * (int64_t)(SIZE) & 63) == 0)                              \
    _mm_prefetch(PFL[j] + (d) * (SIZE), _MM_HINT_T1)

#if defined(__AVX512F__)
/* The 16-lane keys' passes' end: 4 keys' sums for two query heads (a: head ha, b: hb, which
   may be ha), scaled, to the scores. b's first: where hb is ha, a's are the ones kept. */
static inline void store_scores16(const __m512 a[4], const __m512 b[4], __m128 scale, float* sa,
                                  float* sb) {
    __m256 ra[4], rb[4];
    for (int j = 0; j < 4; j++) {
        ra[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
        rb[j] = _mm256_add_ps(_mm512_castps512_ps256(b[j]), _mm512_extractf32x8_ps(b[j], 1));
    }
    _mm_storeu_ps(sb, _mm_mul_ps(hsum4(rb[0], rb[1], rb[2], rb[3]), scale));
    _mm_storeu_ps(sa, _mm_mul_ps(hsum4(ra[0], ra[1], ra[2], ra[3]), scale));
}
#endif

int attn_dpbf16 = 1;
#if defined(__AVX512BF16__)
/* The keys' pass of a chunk (scores sc[h * n4 + i], scaled) for bf16 keys and a bf16 query qh
   [Hq, D] in the model's order, D % 32 == 0: q.k by VDPBF16PS, 32 products a
   row per instruction (the exact products of two bf16 values, summed in fp32, as the 8-lane
   path's FMAs on the widened values; only the order of the sums differs, and denormal inputs
   count as 0). The 8-lane path spends ~7 instructions per 16 values of a key and a head on
   widening and multiplying; here 1 per 32. Loads, prefetches and order as that path's. */
static void keys_dpbf16(const uint16_t* qh, const uint16_t* kp, const uint16_t* vp,
                        const int64_t* sl, int64_t n, int64_t Hq, int64_t Hkv, int64_t D,
                        float scale, float* sc) {
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;
    __m128 s4 = _mm_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 4) {
        const uint16_t *kr[4], *ahead[4];
        FOUR_KEY_ROWS(kr, ahead, block);
        for (int64_t hk = 0; hk < Hkv; hk++) {
            HEAD_LINES(pfl, ahead, block, hk);
            for (int64_t g0 = 0; g0 < group; g0 += 2) {
                int64_t ha = hk * group + g0, hb = g0 + 1 < group ? ha + 1 : ha;
                const uint16_t* qa = qh + ha * D;
                const uint16_t* qw = qh + hb * D;
                __m512 a[4], b[4];
                for (int j = 0; j < 4; j++) a[j] = b[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 32) {
                    __m512bh xa = (__m512bh)_mm512_loadu_si512(qa + d);
                    __m512bh xb = (__m512bh)_mm512_loadu_si512(qw + d);
                    for (int j = 0; j < 4; j++) {
                        if (g0 == 0 && pfl[j]) _mm_prefetch(pfl[j] + d * 2, _MM_HINT_T1);
                        __m512bh k = (__m512bh)_mm512_loadu_si512(kr[j] + hk * D + d);
                        a[j] = _mm512_dpbf16_ps(a[j], xa, k);
                        b[j] = _mm512_dpbf16_ps(b[j], xb, k);
                    }
                }
                store_scores16(a, b, s4, sc + ha * n4 + i, sc + hb * n4 + i);
            }
        }
    }
}
#define HAVE_KEYS_DPBF16 1
#else
#define HAVE_KEYS_DPBF16 0
static void keys_dpbf16(const uint16_t* qh, const uint16_t* kp, const uint16_t* vp,
                        const int64_t* sl, int64_t n, int64_t Hq, int64_t Hkv, int64_t D,
                        float scale, float* sc) {
    (void)qh, (void)kp, (void)vp, (void)sl, (void)n, (void)Hq, (void)Hkv, (void)D, (void)scale;
    (void)sc;
}
#endif

int attn_v512 = 1;
#if defined(__AVX512F__)
/* The values' pass of a chunk for bf16 values, D % 32 == 0, on 16 lanes: po [Hq, D] (zeroed)
   += p * v in the stored order of the 8-lane path (per 16 values the 8 even, then the 8 odd),
   each accumulator lane getting the same FMAs in the same order as there, so the same bits.
   32 values a load: the shift gives the even ones of two 16-value blocks, the mask the odd
   ones, and one 128-bit-lane shuffle each puts them in the stored order ([b0 even | b0 odd],
   [b1 even | b1 odd]): ~40% fewer instructions than two 8-lane halves. Loads, prefetches and
   order as that path's. */
static void values_512(const uint16_t* kp, const uint16_t* vp, const int64_t* sl, int64_t n,
                       const int64_t* nsl, int64_t nn, int64_t Hq, int64_t Hkv, int64_t D,
                       const float* sc, float* po) {
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t i = 0; i < n; i += 4) {
        const uint16_t *vr[4], *ahead[4];
        FOUR_VALUE_ROWS(vr, ahead, block);
        for (int64_t hk = 0; hk < Hkv; hk++) {
            HEAD_LINES(pfl, ahead, block, hk);
            for (int64_t g0 = 0; g0 < group; g0 += 2) {
                int64_t ha = hk * group + g0;
                int two = g0 + 1 < group;
                const float* pa = sc + ha * n4 + i;
                const float* pb = two ? pa + n4 : pa; /* padded keys weigh 0 */
                __m512 wa[4], wb[4];
                for (int j = 0; j < 4; j++) {
                    wa[j] = _mm512_set1_ps(pa[j]);
                    wb[j] = _mm512_set1_ps(pb[j]);
                }
                float* oa = po + ha * D;
                float* ob = two ? oa + D : 0;
                for (int64_t d = 0; d < D; d += 32) {
                    __m512 v0[4], v1[4];
                    for (int j = 0; j < 4; j++) {
                        if (g0 == 0 && pfl[j]) _mm_prefetch(pfl[j] + d * 2, _MM_HINT_T1);
                        __m512i raw = _mm512_loadu_si512(vr[j] + hk * D + d);
                        __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                        __m512 o = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
                        v0[j] = _mm512_shuffle_f32x4(e, o, 0x44); /* [b0 even | b0 odd] */
                        v1[j] = _mm512_shuffle_f32x4(e, o, 0xEE); /* [b1 even | b1 odd] */
                    }
                    __m512 x0 = _mm512_loadu_ps(oa + d), x1 = _mm512_loadu_ps(oa + d + 16);
                    for (int j = 0; j < 4; j++) {
                        x0 = _mm512_fmadd_ps(wa[j], v0[j], x0);
                        x1 = _mm512_fmadd_ps(wa[j], v1[j], x1);
                    }
                    _mm512_storeu_ps(oa + d, x0);
                    _mm512_storeu_ps(oa + d + 16, x1);
                    if (!ob) continue;
                    x0 = _mm512_loadu_ps(ob + d), x1 = _mm512_loadu_ps(ob + d + 16);
                    for (int j = 0; j < 4; j++) {
                        x0 = _mm512_fmadd_ps(wb[j], v0[j], x0);
                        x1 = _mm512_fmadd_ps(wb[j], v1[j], x1);
                    }
                    _mm512_storeu_ps(ob + d, x0);
                    _mm512_storeu_ps(ob + d + 16, x1);
                }
            }
        }
    }
}
#define HAVE_VALUES512 1
#else
#define HAVE_VALUES512 0
static void values_512(const uint16_t* kp, const uint16_t* vp, const int64_t* sl, int64_t n,
                       const int64_t* nsl, int64_t nn, int64_t Hq, int64_t Hkv, int64_t D,
                       const float* sc, float* po) {
    (void)kp, (void)vp, (void)sl, (void)n, (void)nsl, (void)nn, (void)Hq, (void)Hkv, (void)D;
    (void)sc, (void)po;
}
#endif

/* A switch for tests and benchmarks (1 = on): e4m3 pools' passes on 16 lanes. They widen the
   codes to their values times 2^-8 (fp8.h) and fold the 256 into the scores' scale and the
   values' weights (exact: a power of two). */
int attn_e4m3_512 = 1;
#if defined(__AVX512F__)
/* The keys' pass of a chunk for e4m3 keys (--kv-cache-dtype fp8), D % 16 == 0, on 16 lanes:
   the 8-lane path's products of the widened keys and the fp32 query (qb, in order), 16 codes
   a load, two query heads per widened key. Loads, prefetches and order as that path's. */
static void keys_e4m3(const float* qb, const uint8_t* kp, const uint8_t* vp, const int64_t* sl,
                      int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* sc) {
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;
    __m128 s4 = _mm_set1_ps(scale * 256.f);
    for (int64_t i = 0; i < n; i += 4) {
        const uint8_t *kr[4], *ahead[4];
        FOUR_KEY_ROWS(kr, ahead, block);
        for (int64_t hk = 0; hk < Hkv; hk++) {
            HEAD_LINES(pfl, ahead, block, hk);
            for (int64_t g0 = 0; g0 < group; g0 += 2) {
                int64_t ha = hk * group + g0, hb = g0 + 1 < group ? ha + 1 : ha;
                const float* qa = qb + ha * D;
                const float* qw = qb + hb * D;
                __m512 a[4], b[4];
                for (int j = 0; j < 4; j++) a[j] = b[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16) {
                    __m512 xa = _mm512_loadu_ps(qa + d), xb = _mm512_loadu_ps(qw + d);
                    for (int j = 0; j < 4; j++) {
                        if (g0 == 0 && pfl[j] && (d & 63) == 0)
                            _mm_prefetch(pfl[j] + d, _MM_HINT_T1);
                        __m512 k = e4m3x16_low(kr[j] + hk * D + d);
                        a[j] = _mm512_fmadd_ps(k, xa, a[j]);
                        b[j] = _mm512_fmadd_ps(k, xb, b[j]);
                    }
                }
                store_scores16(a, b, s4, sc + ha * n4 + i, sc + hb * n4 + i);
            }
        }
    }
}

/* The values' pass of a chunk for e4m3 values, D % 16 == 0, on 16 lanes: po [Hq, D] (zeroed,
   in order) += p * v, each widened value used by two query heads. */
static void values_e4m3(const uint8_t* kp, const uint8_t* vp, const int64_t* sl, int64_t n,
                        const int64_t* nsl, int64_t nn, int64_t Hq, int64_t Hkv, int64_t D,
                        const float* sc, float* po) {
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3;
    for (int64_t i = 0; i < n; i += 4) {
        const uint8_t *vr[4], *ahead[4];
        FOUR_VALUE_ROWS(vr, ahead, block);
        for (int64_t hk = 0; hk < Hkv; hk++) {
            HEAD_LINES(pfl, ahead, block, hk);
            for (int64_t g0 = 0; g0 < group; g0 += 2) {
                int64_t ha = hk * group + g0;
                int two = g0 + 1 < group;
                const float* pa = sc + ha * n4 + i;
                const float* pb = two ? pa + n4 : pa; /* padded keys weigh 0 */
                __m512 wa[4], wb[4];
                for (int j = 0; j < 4; j++) {
                    wa[j] = _mm512_set1_ps(pa[j] * 256.f);
                    wb[j] = _mm512_set1_ps(pb[j] * 256.f);
                }
                float* oa = po + ha * D;
                float* ob = two ? oa + D : 0;
                for (int64_t d = 0; d < D; d += 16) {
                    __m512 v[4];
                    for (int j = 0; j < 4; j++) {
                        if (g0 == 0 && pfl[j] && (d & 63) == 0)
                            _mm_prefetch(pfl[j] + d, _MM_HINT_T1);
                        v[j] = e4m3x16_low(vr[j] + hk * D + d);
                    }
                    __m512 x = _mm512_loadu_ps(oa + d);
                    for (int j = 0; j < 4; j++) x = _mm512_fmadd_ps(wa[j], v[j], x);
                    _mm512_storeu_ps(oa + d, x);
                    if (!ob) continue;
                    x = _mm512_loadu_ps(ob + d);
                    for (int j = 0; j < 4; j++) x = _mm512_fmadd_ps(wb[j], v[j], x);
                    _mm512_storeu_ps(ob + d, x);
                }
            }
        }
    }
}
#define HAVE_E4M3_512 1
#else
#define HAVE_E4M3_512 0
static void keys_e4m3(const float* qb, const uint8_t* kp, const uint8_t* vp, const int64_t* sl,
                      int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* sc) {
    (void)qb, (void)kp, (void)vp, (void)sl, (void)n, (void)Hq, (void)Hkv, (void)D, (void)scale;
    (void)sc;
}
static void values_e4m3(const uint8_t* kp, const uint8_t* vp, const int64_t* sl, int64_t n,
                        const int64_t* nsl, int64_t nn, int64_t Hq, int64_t Hkv, int64_t D,
                        const float* sc, float* po) {
    (void)kp, (void)vp, (void)sl, (void)n, (void)nsl, (void)nn, (void)Hq, (void)Hkv, (void)D;
    (void)sc, (void)po;
}
#endif

/* LOAD16: 16 keys' values as two fp32 vectors in the stored order; LOAD8: 8 in order (the
   tail of a head); PERM: whether LOAD16 reorders. */
#define ATTN(NAME, KT, LOAD16, LOAD8, PERM)                                                   \
static void NAME##_chunk(const float* qb, const KT* kp, const KT* vp, const int64_t* sl,     \
                         int64_t n, const int64_t* nsl, int64_t nn, int64_t Hq, int64_t Hkv, \
                         int64_t D, float scale, float* sc, float* po, const uint16_t* qh,  \
                         int v512) {                                                        \
    int64_t group = Hq / Hkv, row = Hkv * D, n4 = (n + 3) & ~(int64_t)3, D16 = D & ~15;     \
    float* pm = po + Hq * D;                                                                \
    float* pl = pm + Hq;                                                                    \
    __m128 s4 = _mm_set1_ps(scale);                                                         \
    /* e4m3 keys and values: both passes on 16 lanes where the build has them */           \
    int e16 = HAVE_E4M3_512 && attn_e4m3_512 && sizeof(KT) == 1 && D % 16 == 0;             \
    if (qh)                                                                                 \
        keys_dpbf16(qh, (const uint16_t*)kp, (const uint16_t*)vp, sl, n, Hq, Hkv, D, scale, \
                    sc);                                                                    \
    if (e16)                                                                                \
        keys_e4m3(qb, (const uint8_t*)kp, (const uint8_t*)vp, sl, n, Hq, Hkv, D, scale, sc); \
    for (int64_t i = 0; i < (qh || e16 ? 0 : n); i += 4) {                                  \
        const KT *kr[4], *ahead[4];                                                         \
        FOUR_KEY_ROWS(kr, ahead, block);                                                    \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            HEAD_LINES(pfl, ahead, block, hk);                                              \
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
                        LINE_AT(pfl, j, d, sizeof(KT));                                     \
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
                        LINE_AT(pfl, j, D16, sizeof(KT));                                   \
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
    if (v512)                                                                               \
        values_512((const uint16_t*)kp, (const uint16_t*)vp, sl, n, nsl, nn, Hq, Hkv, D, sc, \
                   po);                                                                     \
    if (e16)                                                                                \
        values_e4m3((const uint8_t*)kp, (const uint8_t*)vp, sl, n, nsl, nn, Hq, Hkv, D, sc, \
                    po);                                                                    \
    for (int64_t i = 0; i < (v512 || e16 ? 0 : n); i += 4) {                                \
        const KT *vr[4], *ahead[4];                                                         \
        FOUR_VALUE_ROWS(vr, ahead, block);                                                  \
        for (int64_t hk = 0; hk < Hkv; hk++) {                                              \
            HEAD_LINES(pfl, ahead, block, hk);                                              \
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
                    for (int j = 0; j < 4; j++) {                                           \
                        LINE_AT(pfl, j, d, sizeof(KT));                                     \
                        LOAD16(vr[j] + hk * D + d, &ve[j], &vo[j]);                         \
                    }                                                                       \
                    add_values16(oa + d, wa, ve, vo);                                       \
                    if (ob) add_values16(ob + d, wb, ve, vo);                               \
                }                                                                           \
                if (D16 < D) {                                                              \
                    __m256 v8[4];                                                           \
                    for (int j = 0; j < 4; j++) {                                           \
                        LINE_AT(pfl, j, D16, sizeof(KT));                                   \
                        v8[j] = LOAD8(vr[j] + hk * D + D16);                                \
                    }                                                                       \
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
    int64_t chunk, T, *first, *owner, *done, row_bytes = Hkv * D * (int64_t)sizeof(KT);     \
    if (k_new && sizeof(KT) == 1) /* an fp8 pool: new rows in q's dtype, rounded here */    \
        write_new_e4m3((uint8_t*)kp, (uint8_t*)vp, k_new, k_stride, v_new, v_stride,         \
                       new_slots, B, Hkv * D, q_bf16);                                      \
    else if (k_new)                                                                         \
        write_new(kp, vp, k_new, k_stride, v_new, v_stride, new_slots, B, row_bytes);       \
    float* part = plan_chunks(lens, B, Hq, D, &chunk, &T, &first, &owner, &done);           \
    if (!part) return;                                                                      \
    int64_t stride = Hq * (D + 2);                                                          \
    /* bf16 keys and query: the keys' pass on VDPBF16PS where the build has it. */          \
    const uint16_t* qh = HAVE_KEYS_DPBF16 && attn_dpbf16 && sizeof(KT) == 2 && q_bf16 &&    \
                                 D % 32 == 0                                                \
                             ? (const uint16_t*)q                                           \
                             : 0;                                                           \
    /* bf16 values: their pass on 16 lanes where the build has them (the same bits). */     \
    int v512 = HAVE_VALUES512 && attn_v512 && sizeof(KT) == 2 && D % 32 == 0;              \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
        float* sc = (float*)worker_scratch(sizeof(float) * Hq * (chunk + D));               \
        float* qf = sc + Hq * chunk;                                                        \
        int64_t held = -1; /* the request whose query qf holds */                           \
        _Pragma("omp for schedule(dynamic) nowait")                                         \
        for (int64_t t = 0; t < T; t++) {                                                   \
            int64_t b = owner[t], c0 = (t - first[b]) * chunk;                              \
            int64_t n = lens[b] - c0 < chunk ? lens[b] - c0 : chunk;                        \
            if (b != held) gather_query(q, b * q_stride, q_bf16, Hq, D, PERM, qf);          \
            held = b;                                                                       \
            /* The task this thread likely takes next (tasks go out in turn): its first keys \
               are prefetched at the end of this one's values, not met cold. */            \
            int64_t t2 = t + omp_get_num_threads(), b2 = t2 < T ? owner[t2] : 0;            \
            int64_t c2 = t2 < T ? (t2 - first[b2]) * chunk : 0;                             \
            int64_t n2 = t2 < T && lens[b2] > c2 ? lens[b2] - c2 : 0;                       \
            NAME##_chunk(qf, kp, vp, slots + b * kmax + c0, n, slots + b2 * kmax + c2,      \
                         n2 < chunk ? n2 : chunk, Hq, Hkv, D, scale, sc, part + t * stride, \
                         qh ? qh + b * q_stride : 0, v512);                                 \
            /* The thread that finishes a request's last chunk merges its chunks. */        \
            if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == first[b + 1] - first[b]) \
                merge_request(part, first, b, Hq, D, PERM, out, out_bf16);                  \
        }                                                                                   \
    }                                                                                       \
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

/* write_new for an fp8 pool: each of a row's `row` values (bf16 or fp32, `src_bf16`) rounded. */
static void write_new_e4m3(uint8_t* kp, uint8_t* vp, const void* k_new, int64_t k_stride,
                           const void* v_new, int64_t v_stride, const int64_t* new_slots,
                           int64_t B, int64_t row, int src_bf16) {
    for (int64_t b = 0; b < B; b++)
        for (int kv = 0; kv < 2; kv++) {
            const char* src = kv ? (const char*)v_new + b * v_stride
                                 : (const char*)k_new + b * k_stride;
            e4m3_row(src, src_bf16, row, (kv ? vp : kp) + new_slots[b] * row, 0);
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

/* Scratch kept between calls instead of ~6 mallocs a call (28 calls a decode step, each a
   few microseconds at one row): a step's layers ask for the same sizes. Thread-local, so two
   callers (and the OpenMP workers, each with its own) never share one. NULL: out of memory. */
typedef struct {
    void* p;
    size_t bytes;
} Scratch;
static void* grow(Scratch* s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->p);
        s->p = NULL;
        s->bytes = 0;
        if (posix_memalign(&s->p, 64, bytes) != 0) return NULL;
        s->bytes = bytes;
    }
    return s->p;
}
static __thread Scratch plan_scratch, worker_scratch_;
static void* worker_scratch(size_t bytes) { return grow(&worker_scratch_, bytes); }

/* Chunk length (a multiple of 4, 16..128: enough tasks for every thread, few merges; one
   request's keys in as few chunks as fill the threads evenly, since each chunk starts its two
   passes on cold rows and adds a part to merge: at one thread a 65-key request is one chunk,
   not four; Qwen3-0.6B B=1 decode attention ~12% less time, 1 thread, AMD EPYC Zen 4), the
   chunks' first index per request, each chunk's request, the chunks attended per request
   (zeroed), and the chunks' partial results, all in the calling thread's scratch. */
static float* plan_chunks(const int64_t* lens, int64_t B, int64_t Hq, int64_t D,
                          int64_t* chunk, int64_t* T, int64_t** first, int64_t** owner,
                          int64_t** done) {
    int64_t total = 0, threads = omp_get_max_threads(), tasks = 0;
    for (int64_t b = 0; b < B; b++) total += lens[b];
    int64_t c = (total + 4 * threads - 1) / (4 * threads);
    if (B == 1) { /* as few chunks of <= 128 keys as a multiple of the threads takes */
        int64_t per = (total + threads * 128 - 1) / (threads * 128);
        c = (total + threads * per - 1) / (threads * per);
    }
    c = c < 16 ? 16 : (c > 128 ? 128 : c);
    *chunk = c = (c + 3) & ~(int64_t)3;
    for (int64_t b = 0; b < B; b++) tasks += ((lens[b] > 0 ? lens[b] : 1) + c - 1) / c;
    size_t words = (size_t)(B + 1 + tasks + B), head = (words * 8 + 63) & ~(size_t)63;
    char* mem = (char*)grow(&plan_scratch, head + sizeof(float) * tasks * Hq * (D + 2));
    if (!mem) return NULL;
    *first = (int64_t*)mem;
    *owner = *first + B + 1;
    *done = *owner + tasks;
    (*first)[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lens[b] > 0 ? lens[b] : 1;
        (*first)[b + 1] = (*first)[b] + (n + c - 1) / c;
        (*done)[b] = 0;
    }
    *T = tasks;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = (*first)[b]; t < (*first)[b + 1]; t++) (*owner)[t] = b;
    return (float*)(mem + head);
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
ATTN(decode_attn_e4m3, uint8_t, load16_e4m3, load8_e4m3, 0)

/* Causal attention of a prefill step's prompts, straight from the step's q/k/v rows (views of
   the qkv projection: rows `q_stride`, `k_stride`, `v_stride` elements apart, a row's heads
   packed, bf16). Sequence i's new tokens are the step's rows q_rows[i] .. + lens[i]; where
   pre_lens is given, a cached prefix of pre_lens[i] tokens comes first, its keys and values
   read from the pool (k_pool/v_pool rows `pool_stride` apart) at slots slots[slot_ofs[i] ..];
   the new tokens' own keys come from the step's rows. Its output goes to out rows o_rows[i] ..
   (out [*, Hq * D], rows `out_stride` apart, bf16). torch's CPU flash kernel ran this at ~1/3
   of what the same tiles do in a matmul (Qwen3-0.6B heads, 128-token prompts: 11% of a
   prefill step for ~2% of its arithmetic).

   A task is a run of 16-row query blocks of one (sequence, KV head): first the keys and
   values its last row sees are packed in the thread's buffers (keys: 16 keys x 32 dims per
   tile, dims in pairs; values: 32 keys x 16 dims, keys in pairs; zeros past the last key),
   then for each of the KV head's query heads and each block (on AMX each pair of blocks,
   prefill_attn_pairs): the scores of the 16 x D queries over the keys up to the block's last
   row (fp32) into a row buffer, the causal
   softmax per row (fp32, the probabilities rounded to bf16 for the value product, as torch's
   flash kernel does), and P . V; the rows are divided by their softmax sums at the end. D is
   64 or 128, prefix + new tokens <= PREFILL_MAX_LEN.

   Two forms of the products, all else shared. Where the CPU grants AMX-BF16: the packed
   blocks are B tiles, the queries and probabilities A tiles (TDPBF16PS). With AVX512-BF16 and
   no AMX (AMD Zen 4) the same packed rows are VDPBF16PS's operands as they lie: a key tile row
   is 16 keys x one dim pair, a value tile row one key pair x 16 dims, so a register tile of 4
   query rows x 4 such vectors takes one broadcast 32-bit pair per row and one load per vector
   (16 accumulators; 8 rows x 3 key blocks for the scores measured the same on the Zen 4
   below). There (AMD EPYC Zen 4, avx512f/bw/vl, avx512_bf16, avx512_vnni, no AMX;
   Qwen3-0.6B heads, 16 q / 8 KV heads, D 128; against torch SDPA, interleaved) the call took
   0.23x SDPA's time for one 512-token prompt and 0.29x for four of 128 (1 thread, CPU time;
   ~160 GFLOP/s of the causal products, about a bf16 matmul's rate there), 0.22x and 0.28x
   (2 threads, wall); a whole 512-token prefill step 0.79x. The two forms agree up to the
   order of the fp32 sums. Returns 0 where it cannot run (neither form, a shape it does not
   take, prefill_attn_pick 0: nothing written), 1 when done. */
#define PREFILL_MAX_LEN 8192
#include "amx.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PF_AMX 1
#else
#define PF_AMX 0
#endif
#if defined(__AVX512BF16__)
#define PF_DP 1
#else
#define PF_DP 0
#endif

/* The most capable form a call may take (tests, benchmarks): 2 AMX where granted, 1 the
   VDPBF16PS form, 0 none (the caller's SDPA). */
int prefill_attn_pick = 2;
/* Whether an AMX item takes two 16-row query blocks at once (scores_amx2, values_amx2: each key
   and value tile loaded once for 32 rows), 1, or one (0: tests, which compare the bits). Intel
   Xeon with AMX, 2 threads, Qwen3-0.6B heads: a 2048-token prompt 17.1 -> 15.4-16.6 ms a layer,
   4096 tokens 73.6 -> 65.4, 512 tokens 1.30 -> 1.23; 128-token prompts the same. */
int prefill_attn_pairs = 1;

#if PF_AMX || PF_DP
#define TILE_U32 256 /* one packed tile: 16 rows x 64 bytes */

static int prefill_form(void) {
    if (PF_AMX && prefill_attn_pick >= 2 && amx_ready()) return 2;
    if (PF_DP && prefill_attn_pick >= 1) return 1;
    return 0;
}

/* Keys kb*16 .. +16 (row pointers `k`, zeros past n) as D / 32 tiles: tile c row j, lane
   n = dims (32c + 2j, 32c + 2j + 1) of key n. A block's tiles are adjacent, so its row
   p = 16c + j is dim pair p. */
static void pack_keys(const uint16_t* const* k, int64_t n, int64_t kb, int64_t D,
                      uint32_t* dst) {
    for (int64_t c = 0; c < D / 32; c++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            int64_t key = kb * 16 + i;
            r[i] = key < n ? _mm512_loadu_si512(k[key] + c * 32) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(dst + c * TILE_U32 + j * 16, r[j]);
    }
}

/* Keys kb*32 .. +32 (row pointers `v`, zeros past n) as D / 16 tiles: tile c row j, lane
   n = dim 16c + n of keys (32kb + 2j, 32kb + 2j + 1). */
static void pack_values(const uint16_t* const* v, int64_t n, int64_t kb, int64_t D,
                        uint32_t* dst) {
    for (int j = 0; j < 16; j++) {
        int64_t k0 = kb * 32 + 2 * j, k1 = k0 + 1;
        for (int64_t c = 0; c < D / 16; c++) {
            __m512i lo = k0 < n ? _mm512_cvtepu16_epi32(
                                      _mm256_loadu_si256((const __m256i*)(v[k0] + c * 16)))
                                : _mm512_setzero_si512();
            __m512i hi = k1 < n ? _mm512_cvtepu16_epi32(
                                      _mm256_loadu_si256((const __m256i*)(v[k1] + c * 16)))
                                : _mm512_setzero_si512();
            _mm512_store_si512(dst + c * TILE_U32 + j * 16,
                               _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* Per-call scratch, kept between calls (a step's layers ask for the same sizes); one per
   calling thread, so that two callers never share it. */
static __thread void* pf_scratch = NULL;
static __thread size_t pf_scratch_bytes = 0;
static void* scratch(size_t bytes) {
    if (bytes > pf_scratch_bytes) {
        free(pf_scratch);
        pf_scratch = NULL;
        pf_scratch_bytes = 0;
        if (posix_memalign(&pf_scratch, 64, bytes) != 0) return NULL;
        pf_scratch_bytes = bytes;
    }
    return pf_scratch;
}

/* Softmax of row buffer s[0 .. n) (raw scores, times `scale`) into bf16 p[0 .. n32) (zeros
   past n); returns the sum of the fp32 exponentials. The exponentials are 2^(log2(e) * scale *
   (s - max)) (exp2_16: 10 ops where exp16 took 15), rounded to bf16 by one VCVTNEPS2BF16 (the
   same nearest-even bits as bias16_bf16's four ops: every value is a normal float here). This
   loop is about a third of the kernel's time at 2048 tokens; these made it 1.1x faster (Intel
   Xeon with AMX, 2 threads, a 2048-token prompt of Qwen3-0.6B heads: 15.4 -> 13.8-14.1 ms a
   layer; 512 tokens 1.17-1.20 -> 1.08). */
static float softmax_row(const float* s, int64_t n, int64_t n32, float scale, uint16_t* p) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + i));
    }
    const float to2 = scale * 1.44269504088896341f; /* log2(e) * scale */
    __m512 sc = _mm512_set1_ps(to2), tot = _mm512_setzero_ps();
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * to2);
    for (int64_t i = 0; i < n32; i += 16) {
        int64_t left = n - i;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF
                      : left > 0 ? (__mmask16)((1u << left) - 1)
                                 : (__mmask16)0;
        __m512 e = _mm512_maskz_mov_ps(
            m, exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + i), sc, top)));
        tot = _mm512_add_ps(tot, e);
#if defined(__AVX512BF16__)
        _mm256_storeu_si256((__m256i*)(p + i), (__m256i)_mm512_cvtneps_pbh(e));
#else
        __m256i h = pack16_bf16(e);
        _mm256_storeu_si256((__m256i*)(p + i), h);
#endif
    }
    return _mm512_reduce_add_ps(tot);
}

#if PF_AMX
/* Scores of the 16 x D queries (qbuf) over key blocks 0 .. nkb into s (rows sp_len apart):
   the queries in A tiles 4 .. 4 + nc - 1 (nc = D / 32, 2 or 4: tile numbers are immediates),
   two key blocks at a time (C tiles 0, 1; B tiles 2, 3). */
static void scores_amx(const uint16_t* qbuf, const uint32_t* kp, int64_t nkb, int64_t D,
                       float* s, int64_t sp_len) {
    int64_t nc = D / 32;
    _tile_loadd(4, qbuf, D * 2);
    _tile_loadd(5, qbuf + 32, D * 2);
    if (nc == 4) {
        _tile_loadd(6, qbuf + 64, D * 2);
        _tile_loadd(7, qbuf + 96, D * 2);
    }
    for (int64_t kb = 0; kb < nkb; kb += 2) {
        const uint32_t* b0 = kp + kb * nc * TILE_U32;
        int two = kb + 1 < nkb;
        _tile_zero(0);
        _tile_zero(1);
#define QK_STEP(C, A)                                                                      \
    _tile_loadd(2, b0 + (C) * TILE_U32, 64);                                               \
    _tile_dpbf16ps(0, A, 2);                                                               \
    if (two) {                                                                             \
        _tile_loadd(3, b0 + (nc + (C)) * TILE_U32, 64);                                    \
        _tile_dpbf16ps(1, A, 3);                                                           \
    }
        QK_STEP(0, 4)
        QK_STEP(1, 5)
        if (nc == 4) {
            QK_STEP(2, 6)
            QK_STEP(3, 7)
        }
#undef QK_STEP
        _tile_stored(0, s + kb * 16, sp_len * 4);
        if (two) _tile_stored(1, s + kb * 16 + 16, sp_len * 4);
    }
}

/* obuf [16, D] = P (bf16 rows sp_len apart, nk32 keys) . V: 64 dims a pass (C tiles 0-3),
   P in A tile 4, values in B tiles 5, 6. */
static void values_amx(const uint16_t* p, int64_t sp_len, const uint32_t* vp, int64_t nk32,
                       int64_t D, float* obuf) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t c0 = d0 / 16;
        amx_zero_tiles_0_3();
        for (int64_t kb = 0; kb < nk32 / 32; kb++) {
            const uint32_t* b = vp + kb * (D / 16) * TILE_U32 + c0 * TILE_U32;
            _tile_loadd(4, p + kb * 32, sp_len * 2);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + TILE_U32, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, b + 2 * TILE_U32, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, b + 3 * TILE_U32, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, obuf + d0, D * 4);
        _tile_stored(1, obuf + d0 + 16, D * 4);
        _tile_stored(2, obuf + d0 + 32, D * 4);
        _tile_stored(3, obuf + d0 + 48, D * 4);
    }
}

/* scores_amx for 32 query rows (qbuf rows 0-31: two 16-row blocks): each key tile is loaded
   once for both blocks (C tiles 0, 1: the blocks over key block kb; 2, 3: over kb + 1; B tiles
   6, 7 the keys; A tiles 4, 5 the blocks' queries, reloaded from L1 per dim chunk), half the
   key loads of two scores_amx calls; the same products in the same order, so the same bits. */
static void scores_amx2(const uint16_t* qbuf, const uint32_t* kp, int64_t nkb, int64_t D,
                        float* s, int64_t sp_len) {
    int64_t nc = D / 32;
    const uint16_t* q1 = qbuf + 16 * D;
    float* s1 = s + 16 * sp_len;
    for (int64_t kb = 0; kb < nkb; kb += 2) {
        const uint32_t* b0 = kp + kb * nc * TILE_U32;
        int two = kb + 1 < nkb;
        amx_zero_tiles_0_3();
        for (int64_t c = 0; c < nc; c++) {
            _tile_loadd(6, b0 + c * TILE_U32, 64);
            _tile_loadd(4, qbuf + 32 * c, D * 2);
            _tile_loadd(5, q1 + 32 * c, D * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b0 + (nc + c) * TILE_U32, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, s + kb * 16, sp_len * 4);
        _tile_stored(1, s1 + kb * 16, sp_len * 4);
        if (two) {
            _tile_stored(2, s + kb * 16 + 16, sp_len * 4);
            _tile_stored(3, s1 + kb * 16 + 16, sp_len * 4);
        }
    }
}

/* values_amx for 32 rows of P (two 16-row blocks, sp_len apart), 32 dims a pass: each value
   tile loaded once for both blocks (C tiles 0, 1: block 0 over the pass's two 16-dim tiles; 2,
   3: block 1); the same bits as values_amx per block. */
static void values_amx2(const uint16_t* p, int64_t sp_len, const uint32_t* vp, int64_t nk32,
                        int64_t D, float* obuf) {
    const uint16_t* p1 = p + 16 * sp_len;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const int64_t c0 = d0 / 16;
        amx_zero_tiles_0_3();
        for (int64_t kb = 0; kb < nk32 / 32; kb++) {
            const uint32_t* b = vp + kb * (D / 16) * TILE_U32 + c0 * TILE_U32;
            _tile_loadd(4, p + kb * 32, sp_len * 2);
            _tile_loadd(5, p1 + kb * 32, sp_len * 2);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + TILE_U32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, obuf + d0, D * 4);
        _tile_stored(1, obuf + d0 + 16, D * 4);
        _tile_stored(2, obuf + 16 * D + d0, D * 4);
        _tile_stored(3, obuf + 16 * D + d0 + 16, D * 4);
    }
}

/* The tiles for a thread's share of a call, and back at its end. */
static void pf_amx_begin(void) {
    AmxConfig cfg;
    amx_config_init(&cfg);
    for (int tile = 0; tile < 8; tile++) amx_config_tile(&cfg, tile, 16, 64);
    amx_config(&cfg);
}
static void pf_amx_end(void) { amx_release(); }
#else
static void scores_amx(const uint16_t* qbuf, const uint32_t* kp, int64_t nkb, int64_t D,
                       float* s, int64_t sp_len) {
    (void)qbuf, (void)kp, (void)nkb, (void)D, (void)s, (void)sp_len;
}
static void values_amx(const uint16_t* p, int64_t sp_len, const uint32_t* vp, int64_t nk32,
                       int64_t D, float* obuf) {
    (void)p, (void)sp_len, (void)vp, (void)nk32, (void)D, (void)obuf;
}
/* The pair forms run only on AMX (prefill_item takes two blocks only there): the same stubs. */
#define scores_amx2 scores_amx
#define values_amx2 values_amx
static void pf_amx_begin(void) {}
static void pf_amx_end(void) {}
#endif

#if PF_DP
/* The 32-bit pair at p (two bf16), in every lane: VDPBF16PS's broadcast operand. */
static inline __m512bh pair16(const uint16_t* p) {
    return (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(p));
}

/* One register tile: `rows` query rows (q, D apart; rows <= 4) x NB key blocks (k: block 0's
   row 0, blocks 16 * np dwords apart) over np dim pairs; raw scores to s (rows sp_len apart).
   NB is a constant at each call (a switch below) so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void qk_tile(const uint16_t* q, int64_t D,
                                                          const uint32_t* k, int64_t np,
                                                          int NB, float* s, int64_t sp_len) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < NB; b++) acc[i][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512bh kv[4];
        for (int b = 0; b < NB; b++) kv[b] = (__m512bh)_mm512_load_si512(k + (b * np + p) * 16);
        for (int i = 0; i < 4; i++) {
            __m512bh qi = pair16(q + i * D + 2 * p);
            for (int b = 0; b < NB; b++) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], qi, kv[b]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(s + i * sp_len + b * 16, acc[i][b]);
}

/* scores_amx's product on VDPBF16PS: rows in fours up to nr (qbuf's rows past nr are zero),
   key blocks in fours. */
static void scores_dp(const uint16_t* qbuf, int nr, const uint32_t* kp, int64_t nkb, int64_t D,
                      float* s, int64_t sp_len) {
    int64_t np = D / 2;
    for (int64_t kb = 0; kb < nkb; kb += 4) {
        const uint32_t* k = kp + kb * np * 16;
        for (int r = 0; r < nr; r += 4) {
            const uint16_t* q = qbuf + r * D;
            float* o = s + r * sp_len + kb * 16;
            switch (nkb - kb < 4 ? nkb - kb : 4) {
            case 1: qk_tile(q, D, k, np, 1, o, sp_len); break;
            case 2: qk_tile(q, D, k, np, 2, o, sp_len); break;
            case 3: qk_tile(q, D, k, np, 3, o, sp_len); break;
            default: qk_tile(q, D, k, np, 4, o, sp_len); break;
            }
        }
    }
}

/* One register tile of P . V: 4 rows of P (bf16, sp_len apart) x 4 16-dim vectors from dim
   chunk c0 (of D / 16), over the key pairs 0 .. nk32 / 2; out rows D apart. */
static void pv_tile(const uint16_t* p, int64_t sp_len, const uint32_t* vp, int64_t nk32,
                    int64_t D, int64_t c0, float* out) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nk32 / 32; kb++) {
        const uint32_t* b = vp + (kb * (D / 16) + c0) * TILE_U32;
        for (int j = 0; j < 16; j++) {
            __m512bh v[4];
            for (int c = 0; c < 4; c++)
                v[c] = (__m512bh)_mm512_load_si512(b + c * TILE_U32 + j * 16);
            for (int i = 0; i < 4; i++) {
                __m512bh pi = pair16(p + i * sp_len + kb * 32 + 2 * j);
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pi, v[c]);
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + i * D + (c0 + c) * 16, acc[i][c]);
}

/* values_amx's product on VDPBF16PS, rows in fours up to nr. */
static void values_dp(const uint16_t* p, int nr, int64_t sp_len, const uint32_t* vp,
                      int64_t nk32, int64_t D, float* obuf) {
    for (int r = 0; r < nr; r += 4)
        for (int64_t c0 = 0; c0 < D / 16; c0 += 4)
            pv_tile(p + r * sp_len, sp_len, vp, nk32, D, c0, obuf + r * D);
}
#else
static void scores_dp(const uint16_t* qbuf, int nr, const uint32_t* kp, int64_t nkb, int64_t D,
                      float* s, int64_t sp_len) {
    (void)qbuf, (void)nr, (void)kp, (void)nkb, (void)D, (void)s, (void)sp_len;
}
static void values_dp(const uint16_t* p, int nr, int64_t sp_len, const uint32_t* vp,
                      int64_t nk32, int64_t D, float* obuf) {
    (void)p, (void)nr, (void)sp_len, (void)vp, (void)nk32, (void)D, (void)obuf;
}
#endif

/* One item: query rows r0 .. r0 + nr of a sequence's head (q: its row 0, head h; row r at
   position pre + r, seeing keys 0 .. pre + r), keys and values packed (kp, vp), output rows
   to `o` (its row 0, head h); `amx` picks the form of the products. nr <= 16, or on AMX <= 32
   (two blocks, scores_amx2 / values_amx2: the first block's scores past its own keys are
   computed and left out of its softmax). */
static void prefill_item(const uint16_t* q, int64_t q_stride, const uint32_t* kp,
                         const uint32_t* vp, int64_t pre, int64_t r0, int nr, int64_t D,
                         float scale, uint16_t* o, int64_t out_stride, float* s, uint16_t* p,
                         int64_t sp_len, uint16_t* qbuf, float* obuf, int amx) {
    int64_t nk = pre + r0 + nr, nkb = (nk + 15) / 16, nk32 = (nk + 31) / 32 * 32;
    const int rows = nr > 16 ? 32 : 16;
    for (int i = 0; i < rows; i++) /* the rows x D queries, zero rows past nr */
        for (int64_t d = 0; d < D; d += 32)
            _mm512_store_si512(qbuf + i * D + d,
                               i < nr ? _mm512_loadu_si512(q + (r0 + i) * q_stride + d)
                                      : _mm512_setzero_si512());
    if (rows == 32)
        scores_amx2(qbuf, kp, nkb, D, s, sp_len);
    else if (amx)
        scores_amx(qbuf, kp, nkb, D, s, sp_len);
    else
        scores_dp(qbuf, nr, kp, nkb, D, s, sp_len);
    float inv[32];
    for (int i = 0; i < rows; i++) {
        if (i < nr) {
            inv[i] = 1.f / softmax_row(s + i * sp_len, pre + r0 + i + 1, nk32, scale,
                                       p + i * sp_len);
        } else {
            memset(p + i * sp_len, 0, nk32 * 2);
            inv[i] = 0.f;
        }
    }
    if (rows == 32)
        values_amx2(p, sp_len, vp, nk32, D, obuf);
    else if (amx)
        values_amx(p, sp_len, vp, nk32, D, obuf);
    else
        values_dp(p, nr, sp_len, vp, nk32, D, obuf);
    for (int i = 0; i < nr; i++) {
        __m512 w = _mm512_set1_ps(inv[i]);
        for (int64_t d = 0; d < D; d += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(obuf + i * D + d), w);
            __m256i h = pack16_bf16(x);
            _mm256_storeu_si256((__m256i*)(o + (r0 + i) * out_stride + d), h);
        }
    }
}

#endif

int prefill_attn(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                 const uint16_t* v, int64_t v_stride, const int64_t* q_rows,
                 const int64_t* o_rows, const int64_t* lens, int64_t nseq, int64_t Hq,
                 int64_t Hkv, int64_t D, float scale, uint16_t* out, int64_t out_stride,
                 const uint16_t* k_pool, const uint16_t* v_pool, int64_t pool_stride,
                 const int64_t* pre_lens, const int64_t* slot_ofs, const int64_t* slots) {
#if PF_AMX || PF_DP
    int form = prefill_form();
    if (!form || (D != 64 && D != 128) || Hq % Hkv != 0) return 0;
    int amx = form == 2;
    int64_t group = Hq / Hkv, max_len = 0, blocks = 0;
    for (int64_t i = 0; i < nseq; i++) {
        int64_t total = lens[i] + (pre_lens ? pre_lens[i] : 0);
        if (total > PREFILL_MAX_LEN) return 0;
        max_len = total > max_len ? total : max_len;
        blocks += (lens[i] + 15) / 16;
    }
    /* Runs are split so that there are a few tasks per thread. */
    int threads = omp_get_max_threads();
    int64_t per_task = blocks * Hkv / (4 * (int64_t)threads);
    per_task = per_task < 1 ? 1 : per_task;
    int64_t* tofs = (int64_t*)malloc(sizeof(int64_t) * (nseq + 1));
    if (!tofs) return 0;
    tofs[0] = 0;
    for (int64_t i = 0; i < nseq; i++)
        tofs[i + 1] = tofs[i] + Hkv * (((lens[i] + 15) / 16 + per_task - 1) / per_task);
    int64_t sp_len = (max_len + 31) / 32 * 32 + 32, kv_tiles = (max_len + 31) / 32;
    size_t kv_bytes = (size_t)kv_tiles * 2 * (D / 32) * TILE_U32 * 4 +
                      (size_t)kv_tiles * (D / 16) * TILE_U32 * 4;
    size_t rows_bytes = (size_t)sp_len * 2 * sizeof(void*);
    size_t per_thread = kv_bytes + rows_bytes + 32 * sp_len * 4 + 32 * sp_len * 2 +
                        32 * D * 2 + 32 * D * 4; /* 32 rows: an AMX item's two blocks */
    char* mem = (char*)scratch(per_thread * threads);
    if (!mem) {
        free(tofs);
        return 0;
    }
#pragma omp parallel
    {
        char* mine = mem + per_thread * omp_get_thread_num();
        uint32_t* kp = (uint32_t*)mine;
        uint32_t* vp = kp + kv_tiles * 2 * (D / 32) * TILE_U32;
        const uint16_t** krow = (const uint16_t**)(mine + kv_bytes);
        const uint16_t** vrow = krow + sp_len;
        float* s = (float*)(mine + kv_bytes + rows_bytes);
        uint16_t* p = (uint16_t*)(s + 32 * sp_len);
        uint16_t* qbuf = p + 32 * sp_len;
        float* obuf = (float*)(qbuf + 32 * D);
        if (amx) pf_amx_begin();
        const int64_t step = amx && prefill_attn_pairs ? 2 : 1; /* query blocks an item takes */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tofs[nseq]; task++) {
            int64_t i = 0;
            while (tofs[i + 1] <= task) i++;
            int64_t n = lens[i], nqb = (n + 15) / 16, local = task - tofs[i];
            int64_t pre = pre_lens ? pre_lens[i] : 0;
            int64_t runs = (nqb + per_task - 1) / per_task;
            int64_t hk = local / runs, qb0 = (local % runs) * per_task;
            int64_t qb1 = qb0 + per_task < nqb ? qb0 + per_task : nqb;
            /* the keys the run's last row sees: the prefix's from the pool, then its own */
            int64_t nk = pre + (qb1 * 16 < n ? qb1 * 16 : n);
            for (int64_t j = 0; j < pre; j++) {
                int64_t row = slots[slot_ofs[i] + j] * pool_stride + hk * D;
                krow[j] = k_pool + row;
                vrow[j] = v_pool + row;
            }
            for (int64_t j = pre; j < nk; j++) {
                krow[j] = k + (q_rows[i] + j - pre) * k_stride + hk * D;
                vrow[j] = v + (q_rows[i] + j - pre) * v_stride + hk * D;
            }
            for (int64_t b = 0; b < (nk + 15) / 16; b++)
                pack_keys(krow, nk, b, D, kp + b * (D / 32) * TILE_U32);
            for (int64_t b = 0; b < (nk + 31) / 32; b++)
                pack_values(vrow, nk, b, D, vp + b * (D / 16) * TILE_U32);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++)
                for (int64_t qb = qb0; qb < qb1; qb += step) {
                    int64_t end = (qb + step < qb1 ? qb + step : qb1) * 16;
                    int nr = (int)((end < n ? end : n) - qb * 16);
                    prefill_item(q + q_rows[i] * q_stride + h * D, q_stride, kp, vp, pre,
                                 qb * 16, nr, D, scale, out + o_rows[i] * out_stride + h * D,
                                 out_stride, s, p, sp_len, qbuf, obuf, amx);
                }
        }
        if (amx) pf_amx_end();
    }
    free(tofs);
    return 1;
#else /* neither form: the caller's SDPA */
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)q_rows;
    (void)o_rows, (void)lens, (void)nseq, (void)Hq, (void)Hkv, (void)D, (void)scale, (void)out;
    (void)out_stride, (void)k_pool, (void)v_pool, (void)pool_stride, (void)pre_lens;
    (void)slot_ofs, (void)slots;
    return 0;
#endif
}

int prefill_attn_form(void) {
#if PF_AMX || PF_DP
    return prefill_form();
#else
    return 0;
#endif
}
