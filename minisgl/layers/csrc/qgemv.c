/* Matmuls over quantized weights (minisgl/quant/qtensor.py's layout), each code byte read once
   per call from memory and turned into numbers in registers or an L1 scratch, never into a
   dequantized copy of the weight:

     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k] - zero[n, g] * xsum[m, g])

   Groups are contiguous runs of `gs` input features (gs % 32 == 0, K % gs == 0).

   Integer codes meet x as 16-bit integers: x is quantized per row (one scale, max|x| / 32767:
   15 bits, far finer than the bf16 activations it comes from) and one VPMADDWD does 16
   products. Sums stay exact in int32 within a group (at most FLUSH features, so they cannot
   overflow) and become fp32 once per group, times the group's scale; the zero points are
   subtracted once per block through the groups' integer sums of x.

   Codes become 16-bit lanes without a shuffle, so a code byte costs one or two single-cycle
   integer ops besides its share of a VPMADDWD (the first version widened with VPMOVZXBW, a
   lane-crossing op one pipe issues every 1.25 cycles on Zen 3, and divided per group): x is
   laid out, when it is quantized, in the order the codes come out of a 32-byte load:
   - 8-bit: a 16-bit lane of the load holds two codes; a mask gives the even feature, a shift
     the odd one (x per 32 features: evens, then odds);
   - 4-bit: a 16-bit lane holds four codes (features 4l..4l+3 of 64); masks and shifts give
     four vectors, vector s holding features 4l+s (x per 64 features in that order). Groups of
     32 (a 64-feature load would span two groups) widen 16 bytes with VPMOVZXBW instead and
     take the 8-bit layout (Q_U4W).
   fp8 e4m3: no integer form, and no F16C either (VCVTPH2PS is 2 uops per 8 on Zen 3 and
   bounded one row at the memory's rate): a code becomes the top half of an fp32 with a shift
   and a mask, its value times 2^-120 exactly (fp8x32), and x is scaled by a power of two per
   row so that the products stay normal; the powers of two are undone per output.

   Blocks of 4 weight rows are split over the threads; the next blocks are prefetched across
   every pass a block takes (common.h), as the bf16 GEMV does. One input row: codes extracted
   in registers, 4 weight rows at once. Two: integer codes extracted in registers two weight
   rows at a time (4x2 accumulators with the codes and x spill AVX2's 16 registers), fp8 pairs
   in registers. Three or more: each code is turned into numbers once per block, integer codes
   into an int16 scratch per segment of <= 512 features, fp8 into fp32 with its scales, and
   every pair of input rows runs over the scratch (in L1) with loads and multiply-adds only.

   What bounds it on a 2-core Zen 3 (AVX2): one row streams the codes at about the bf16
   GEMV's byte rate; from 2 rows on, the products: a VPMADDWD and the VPADDD after it issue
   at ~0.85 cycles per 16 products there (~19 per cycle, little more than FMA's 16), so
   8-bit rows cost about what bf16 rows do. AVX512-VNNI (VPDPWSSD, the AVX-512 build) fuses
   the two. x is quantized (converted) row by row inside the same parallel region, so a call
   wakes the threads once. */
#include "common.h"

/* The next blocks' prefetch (common.h's Prefetch). The AVX-512 build sends the lines to L2
   (T1), as gemv_avx512.c does: a T0 prefetch holds an L1 fill buffer until its line arrives,
   and a core's misses in flight, not its arithmetic, bound one weight stream on the
   Sapphire Rapids-class Xeon measured there (T1: 97-100% of one thread's read rate, T0: 90%). */
#ifdef __AVX512F__
static inline void qprefetch(Prefetch* p) {
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps)
        _mm_prefetch(p->base + 64 * p->issued++, _MM_HINT_T1);
}
#else
#define qprefetch prefetch_step
#endif

/* Q_U4W: 4-bit codes whose groups (32 features) are shorter than a 64-feature load. */
enum { Q_U8 = 0, Q_U4 = 1, Q_FP8 = 2, Q_U4W = 3 };

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

/* Features per step (one 32-byte load of a row's codes, or 16 bytes for Q_U4W), int16 vectors
   it yields, and code bytes it reads. */
static inline int step_features(int kind) { return kind == Q_U4 ? 64 : 32; }
static inline int step_vectors(int kind) { return kind == Q_U4 ? 4 : 2; }
static inline int step_bytes(int kind) { return kind == Q_U4W ? 16 : 32; }

/* Where feature k of a step sits in x's layout (see the top). */
static inline int64_t x_slot(int kind, int64_t k) {
    int64_t base = k & ~(int64_t)(step_features(kind) - 1);
    int64_t in = k - base;
    if (kind == Q_FP8) { /* per 32: features 4q, then 4q+2, 4q+1, 4q+3 (q = 0..7) */
        int64_t s = in & 3;
        return base + (((s >> 1) | ((s & 1) << 1)) << 3) + (in >> 2);
    }
    int v = step_vectors(kind);
    return base + (in % v) * 16 + in / v;
}

/* Two vectors of 16 int16 (features 0-15, 16-31) -> their even and odd features. */
static inline void split_even_odd(__m256i a, __m256i b, __m256i* even, __m256i* odd) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    /* per 128-bit lane: evens in the low 8 bytes, odds in the high; then lanes regrouped */
    a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0xD8);
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, pick), 0xD8);
    *even = _mm256_permute2x128_si256(a, b, 0x20);
    *odd = _mm256_permute2x128_si256(a, b, 0x31);
}

/* 16 floats -> 16 int16 codes, round to nearest even and clamped to +-32767; their sum. */
static inline __m256i codes16(__m256 lo, __m256 hi, __m256 inv, __m256i* sum) {
    const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(lo, inv));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(hi, inv));
    a = _mm256_max_epi32(_mm256_min_epi32(a, top), bottom);
    b = _mm256_max_epi32(_mm256_min_epi32(b, top), bottom);
    *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(a, b));
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

/* x row m -> int16 codes in `kind`'s layout, its scale, and per-group integer sums. */
static void quantize_x(int kind, const void* x, int x_bf16, int64_t m, int64_t K, int64_t gs,
                       int16_t* xq, float* xscale, float* xsum) {
    const float* xf = (const float*)x + m * K;
    const uint16_t* xb = (const uint16_t*)x + m * K;
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t k = 0; k < K; k += 8) {
        __m256 v = x_bf16 ? load_bf16(xb + k) : _mm256_loadu_ps(xf + k);
        amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v, abs_mask));
    }
    __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
    a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
    float amax = _mm_cvtss_f32(a4);
    float s = amax > 0 ? amax / XMAX : 1.0f;
    xscale[m] = s;
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    int16_t* q = xq + m * K;
    int64_t G = K / gs;
    const int S = step_features(kind);
    for (int64_t g = 0; g < G; g++) {
        __m256i sum8 = _mm256_setzero_si256();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += S) { /* steps never cross groups */
            __m256i c[4];
            for (int v = 0; v < S / 16; v++) {
                int64_t at = k + 16 * v;
                __m256 lo = x_bf16 ? load_bf16(xb + at) : _mm256_loadu_ps(xf + at);
                __m256 hi = x_bf16 ? load_bf16(xb + at + 8) : _mm256_loadu_ps(xf + at + 8);
                c[v] = codes16(lo, hi, inv, &sum8);
            }
            __m256i* out = (__m256i*)(q + k);
            if (kind == Q_U4) { /* vector s holds features 4l+s: two rounds of even/odd */
                __m256i e0, o0, e1, o1, s0, s1, s2, s3;
                split_even_odd(c[0], c[1], &e0, &o0);
                split_even_odd(c[2], c[3], &e1, &o1);
                split_even_odd(e0, e1, &s0, &s2);
                split_even_odd(o0, o1, &s1, &s3);
                _mm256_storeu_si256(out, s0);
                _mm256_storeu_si256(out + 1, s1);
                _mm256_storeu_si256(out + 2, s2);
                _mm256_storeu_si256(out + 3, s3);
            } else {
                __m256i e, o;
                split_even_odd(c[0], c[1], &e, &o);
                _mm256_storeu_si256(out, e);
                _mm256_storeu_si256(out + 1, o);
            }
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i*)lanes, sum8);
        int32_t sum = 0;
        for (int j = 0; j < 8; j++) sum += lanes[j];
        xsum[m * G + g] = (float)sum;
    }
}

/* x row m -> fp32 in fp8's layout, times 2^xexp[m] (a power of two that brings max|x| near
   2^64: the weights' fp32 forms are their values times 2^-120, see fp8x32, and their products
   with x must stay clear of the subnormal range). */
static void convert_x(const void* x, int x_bf16, int64_t m, int64_t K, float* xf, int* xexp) {
    const float* f = (const float*)x + m * K;
    const uint16_t* b = (const uint16_t*)x + m * K;
    float amax = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = fabsf(x_bf16 ? bf16_to_f32(b[k]) : f[k]);
        amax = v > amax ? v : amax;
    }
    int e = 0;
    if (amax > 0 && isfinite(amax)) frexpf(amax, &e);
    xexp[m] = 64 - e;
    float p = ldexpf(1.0f, 64 - e);
    for (int64_t k = 0; k < K; k++)
        xf[m * K + x_slot(Q_FP8, k)] = (x_bf16 ? bf16_to_f32(b[k]) : f[k]) * p;
}

/* One step's codes of a row -> int16 vectors e[0..step_vectors) in x's layout. */
static inline __attribute__((always_inline)) void extract(int kind, const uint8_t* p,
                                                           __m256i* e) {
    if (kind == Q_U4W) {
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        e[0] = _mm256_and_si256(v, _mm256_set1_epi16(15));
        e[1] = _mm256_srli_epi16(v, 4);
        return;
    }
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    if (kind == Q_U8) {
        e[0] = _mm256_and_si256(v, _mm256_set1_epi16(0xFF));
        e[1] = _mm256_srli_epi16(v, 8);
    } else {
        const __m256i m4 = _mm256_set1_epi16(15);
        e[0] = _mm256_and_si256(v, m4);
        e[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        e[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), m4);
        e[3] = _mm256_srli_epi16(v, 12);
    }
}

/* 8 e4m3 bytes -> their values times 2^-8 as fp32 (see the top). */
static inline __m256 fp8x8(__m128i bytes_lo8) {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes_lo8); /* byte << 8 per lane */
    h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

/* 32 e4m3 bytes -> four vectors of 8 fp32: their values times 2^-120, exactly (subnormals
   too, as fp32 subnormals), in x's order (features 4q, 4q+2, 4q+1, 4q+3). No F16C: a 16-bit
   lane holds two codes, and each becomes the top half of an fp32 (a bf16) by a shift and a
   mask: its sign stays at bit 15, its exponent and mantissa move to bits 10..4, so the fp32
   exponent field is the code's own (bias 7 read as 127) and its mantissa the code's three
   bits. Then, as the bf16 GEMV does, a 32-bit lane's two halves become two fp32 by a shift
   and a mask. 9 single-cycle ops per 32 codes where VCVTPH2PS took 2 uops per 8 on Zen 3. */
static inline __attribute__((always_inline)) void fp8x32(const uint8_t* p, __m256* w) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    const __m256i keep = _mm256_set1_epi16((short)0x87F0);
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i odd = _mm256_and_si256(_mm256_srai_epi16(v, 4), keep);
    __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), keep);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(even, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(even, hi));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(odd, 16));
    w[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, hi));
}

/* Per (weight row j, input row i) a vector of partial sums; y is their sum. */
typedef struct {
    __m256 v[4][2];
} Acc;

/* Pins v to one register at this point: integer adds reassociate, and GCC otherwise regroups
   the accumulators' adds into trees whose temporaries spill them. */
#define KEEP(v) __asm__("" : "+x"(v))

/* Byte offset of feature k's step in a row of codes. */
static inline int64_t code_at(int kind, int64_t k) { return kind == Q_U8 ? k : k >> 1; }

/* One 4-row block against input row m, integer codes extracted in registers: into acc
   (column 0), each group's scale applied (zero points not yet). A group longer than FLUSH (a
   whole row, per channel) is summed a chunk at a time; a chunk never runs past its group. */
static inline __attribute__((always_inline)) void block_int(
    int kind, const int16_t* xq, const uint8_t* const* wr, const float* const* sr, int64_t m,
    int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const int S = step_features(kind), V = step_vectors(kind);
    const int16_t* x0 = xq + m * K;
    for (int j = 0; j < 4; j++) acc->v[j][0] = _mm256_setzero_ps();
    for (int64_t c0 = 0, g = 0, end; c0 < K; c0 = end, g += end == (g + 1) * gs) {
        end = (g + 1) * gs < c0 + FLUSH ? (g + 1) * gs : c0 + FLUSH;
        __m256i a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_si256();
        for (int64_t k = c0; k < end; k += S) {
            qprefetch(pf);
            for (int j = 0; j < 4; j++) {
                __m256i e[4];
                extract(kind, wr[j] + code_at(kind, k), e);
#ifdef __AVX512VNNI__
                for (int v = 0; v < V; v++)
                    a[j] = DOT16(a[j], e[v], _mm256_loadu_si256((const __m256i*)(x0 + k + 16 * v)));
#else
                /* products summed as a tree: one add on the accumulator's chain per step */
                __m256i t = _mm256_add_epi32(
                    _mm256_madd_epi16(e[0], _mm256_loadu_si256((const __m256i*)(x0 + k))),
                    _mm256_madd_epi16(e[1], _mm256_loadu_si256((const __m256i*)(x0 + k + 16))));
                if (V == 4)
                    t = _mm256_add_epi32(t, _mm256_add_epi32(
                        _mm256_madd_epi16(e[2], _mm256_loadu_si256((const __m256i*)(x0 + k + 32))),
                        _mm256_madd_epi16(e[3], _mm256_loadu_si256((const __m256i*)(x0 + k + 48)))));
                a[j] = _mm256_add_epi32(a[j], t);
#endif
            }
        }
        for (int j = 0; j < 4; j++)
            acc->v[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j]),
                                           _mm256_broadcast_ss(sr[j] + g), acc->v[j][0]);
    }
}

/* Two input rows, integer codes extracted in registers, two weight rows at a time (4x2
   accumulators, the codes and x at once spill AVX2's 16 registers): each code is extracted
   twice, where writing it to a scratch and reading it back costs more at two rows. */
static inline __attribute__((always_inline)) void block_int2(
    int kind, const int16_t* xq, const uint8_t* const* wr, const float* const* sr, int64_t m,
    int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const int S = step_features(kind), V = step_vectors(kind);
    const int16_t* x0 = xq + m * K;
    const int16_t* x1 = x0 + K;
    for (int j = 0; j < 4; j++) acc->v[j][0] = acc->v[j][1] = _mm256_setzero_ps();
    for (int64_t c0 = 0, g = 0, end; c0 < K; c0 = end, g += end == (g + 1) * gs) {
        end = (g + 1) * gs < c0 + FLUSH ? (g + 1) * gs : c0 + FLUSH;
        for (int jh = 0; jh < 4; jh += 2) {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
            for (int64_t k = c0; k < end; k += S) {
                qprefetch(pf);
                __m256i e[4], f[4];
                extract(kind, wr[jh] + code_at(kind, k), e);
                extract(kind, wr[jh + 1] + code_at(kind, k), f);
                for (int v = 0; v < V; v++) {
                    __m256i u = _mm256_loadu_si256((const __m256i*)(x0 + k + 16 * v));
                    __m256i w = _mm256_loadu_si256((const __m256i*)(x1 + k + 16 * v));
                    a0 = DOT16(a0, e[v], u);
                    b0 = DOT16(b0, e[v], w);
                    a1 = DOT16(a1, f[v], u);
                    b1 = DOT16(b1, f[v], w);
                    KEEP(a0);
                    KEEP(b0);
                    KEEP(a1);
                    KEEP(b1);
                }
            }
            __m256 s = _mm256_broadcast_ss(sr[jh] + g), t = _mm256_broadcast_ss(sr[jh + 1] + g);
            acc->v[jh][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), s, acc->v[jh][0]);
            acc->v[jh][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b0), s, acc->v[jh][1]);
            acc->v[jh + 1][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), t, acc->v[jh + 1][0]);
            acc->v[jh + 1][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b1), t, acc->v[jh + 1][1]);
        }
    }
}

/* Several input rows, integer codes: the block's codes are extracted once per segment (<= SEG
   features of one group) into `ws` [4][SEG] int16, in x's layout, and every pair of input
   rows runs over that with loads and multiply-adds only (extracting again per pair would
   cost as much as the products; keeping 4x2 accumulators and the extracted codes in
   registers at once spills on AVX2's 16 registers). acc: a slot per pair of rows. */
#define SEG 512
static inline __attribute__((always_inline)) void pair_int(
    int MR, const int16_t* x0, const int16_t* x1, const int16_t* ws, int64_t n, Prefetch* pf,
    const float* const* sr, int64_t g, Acc* acc) {
    /* named accumulators, not arrays (GCC kept an array of them in memory here), each
       pinned after its add (KEEP): integer adds reassociate, and GCC regrouped them into
       trees whose temporaries spilled the accumulators */
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define PAIR_ROW(a, b, j)                                                              \
    {                                                                                  \
        __m256i w = _mm256_loadu_si256((const __m256i*)(ws + (j) * SEG + k + h));      \
        a = DOT16(a, w, u);                                                            \
        KEEP(a);                                                                       \
        if (MR == 2) b = DOT16(b, w, v);                                               \
        if (MR == 2) KEEP(b);                                                          \
    }
    for (int64_t k = 0; k < n; k += 32) {
        qprefetch(pf);
        for (int h = 0; h < 32; h += 16) {
            __m256i u = _mm256_loadu_si256((const __m256i*)(x0 + k + h));
            __m256i v = MR == 2 ? _mm256_loadu_si256((const __m256i*)(x1 + k + h)) : u;
            PAIR_ROW(a0, b0, 0)
            PAIR_ROW(a1, b1, 1)
            PAIR_ROW(a2, b2, 2)
            PAIR_ROW(a3, b3, 3)
        }
    }
#undef PAIR_ROW
    __m256i as[4] = {a0, a1, a2, a3}, bs[4] = {b0, b1, b2, b3};
    for (int j = 0; j < 4; j++) {
        __m256 s = _mm256_broadcast_ss(sr[j] + g);
        acc->v[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(as[j]), s, acc->v[j][0]);
        if (MR == 2) acc->v[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bs[j]), s, acc->v[j][1]);
    }
}

#ifdef __AVX512F__
/* pair_int on 512-bit vectors (the AVX-512 build): the scratch and x share one layout, so
   any width multiplies them; 32 products per VPDPWSSD where Sapphire Rapids-class cores issue
   two a cycle, twice the 256-bit form's products (8 rows took ~2x one row's time there). The
   sums fold into Acc's 256-bit halves at the end. */
#ifdef __AVX512VNNI__
#define DOT32(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DOT32(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
static inline __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
static inline __attribute__((always_inline)) void pair_int512(
    int MR, const int16_t* x0, const int16_t* x1, const int16_t* ws, int64_t n, Prefetch* pf,
    const float* const* sr, int64_t g, Acc* acc) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    __m512i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define PAIR_ROW512(a, b, j)                                                           \
    {                                                                                  \
        __m512i w = _mm512_loadu_si512((const void*)(ws + (j) * SEG + k));             \
        a = DOT32(a, w, u);                                                            \
        KEEP(a);                                                                       \
        if (MR == 2) b = DOT32(b, w, v);                                               \
        if (MR == 2) KEEP(b);                                                          \
    }
    for (int64_t k = 0; k < n; k += 32) {
        qprefetch(pf);
        __m512i u = _mm512_loadu_si512((const void*)(x0 + k));
        __m512i v = MR == 2 ? _mm512_loadu_si512((const void*)(x1 + k)) : u;
        PAIR_ROW512(a0, b0, 0)
        PAIR_ROW512(a1, b1, 1)
        PAIR_ROW512(a2, b2, 2)
        PAIR_ROW512(a3, b3, 3)
    }
#undef PAIR_ROW512
    __m512i as[4] = {a0, a1, a2, a3}, bs[4] = {b0, b1, b2, b3};
    for (int j = 0; j < 4; j++) {
        __m256 s = _mm256_broadcast_ss(sr[j] + g);
        acc->v[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold512(as[j])), s, acc->v[j][0]);
        if (MR == 2)
            acc->v[j][1] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold512(bs[j])), s, acc->v[j][1]);
    }
}
#define PAIR_INT pair_int512
#else
#define PAIR_INT pair_int
#endif

static inline __attribute__((always_inline)) void block_int_many(
    int kind, const int16_t* xq, const uint8_t* const* wr, const float* const* sr, int64_t M,
    int64_t K, int64_t gs, Prefetch* pf, int16_t* ws, Acc* acc) {
    const int S = step_features(kind), V = step_vectors(kind);
    for (int64_t p = 0; p < (M + 1) / 2; p++)
        for (int j = 0; j < 4; j++) acc[p].v[j][0] = acc[p].v[j][1] = _mm256_setzero_ps();
    for (int64_t c0 = 0, g = 0, end; c0 < K; c0 = end, g += end == (g + 1) * gs) {
        end = (g + 1) * gs < c0 + SEG ? (g + 1) * gs : c0 + SEG;
        for (int j = 0; j < 4; j++)
            for (int64_t k = c0; k < end; k += S) {
                qprefetch(pf);
                __m256i e[4];
                extract(kind, wr[j] + code_at(kind, k), e);
                for (int v = 0; v < V; v++)
                    _mm256_storeu_si256((__m256i*)(ws + j * SEG + (k - c0) + 16 * v), e[v]);
            }
        int64_t m = 0;
        for (; m + 1 < M; m += 2)
            PAIR_INT(2, xq + m * K + c0, xq + (m + 1) * K + c0, ws, end - c0, pf, sr, g,
                     &acc[m / 2]);
        if (m < M) PAIR_INT(1, xq + m * K + c0, NULL, ws, end - c0, pf, sr, g, &acc[m / 2]);
    }
}

/* The same for fp8 codes against fp32 x (one or two rows), converting in registers. */
static inline __attribute__((always_inline)) void block_fp8(
    int MR, const float* xf, const uint8_t* const* wr, const float* const* sr, int64_t m,
    int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const float* x0 = xf + m * K;
    const float* x1 = MR == 2 ? x0 + K : x0;
    for (int j = 0; j < 4; j++) acc->v[j][0] = acc->v[j][1] = _mm256_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, g++) {
        /* FMAs only (no VMULPS): Zen 3 multiplies a subnormal weight at full speed in an FMA,
           not in a VMULPS (measured: random codes, 1 in 16 subnormal, 1.9x the time). One
           row: two chains per weight row; two rows: one each (registers). */
        __m256 a0[4], a1[4];
        for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + gs; k += 32) {
            qprefetch(pf);
            for (int j = 0; j < 4; j++) {
                __m256 w[4];
                fp8x32(wr[j] + k, w);
                if (MR == 1) {
                    a0[j] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x0 + k), a0[j]);
                    a1[j] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x0 + k + 8), a1[j]);
                    a0[j] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x0 + k + 16), a0[j]);
                    a1[j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x0 + k + 24), a1[j]);
                } else {
                    for (int v = 0; v < 4; v++) {
                        a0[j] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(x0 + k + 8 * v), a0[j]);
                        a1[j] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(x1 + k + 8 * v), a1[j]);
                    }
                }
            }
        }
        for (int j = 0; j < 4; j++) {
            __m256 s = _mm256_broadcast_ss(sr[j] + g);
            if (MR == 1) {
                acc->v[j][0] = _mm256_fmadd_ps(_mm256_add_ps(a0[j], a1[j]), s, acc->v[j][0]);
            } else {
                acc->v[j][0] = _mm256_fmadd_ps(a0[j], s, acc->v[j][0]);
                acc->v[j][1] = _mm256_fmadd_ps(a1[j], s, acc->v[j][1]);
            }
        }
    }
}

#ifdef __AVX512F__
static inline __m256 fold512ps(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#endif

/* fp8, many input rows: the block converted (scales applied) KC features at a time into
   `wf` [4][KC] and every pair of rows run over that with FMAs only; acc has a slot per row. */
#define KC 256
static inline __attribute__((always_inline)) void block_fp8_many(
    const float* xf, const uint8_t* const* wr, const float* const* sr, int64_t M, int64_t K,
    int64_t gs, Prefetch* pf, float* wf, Acc* acc) {
    for (int64_t p = 0; p < (M + 1) / 2; p++)
        for (int j = 0; j < 4; j++) acc[p].v[j][0] = acc[p].v[j][1] = _mm256_setzero_ps();
    /* w' * (scale * 2^40), one FMA (see block_fp8): normal fp32 for any scale from 2^-37
       (subnormal codes) to 2^88, and one rounding, as dequantize's code * scale */
    const __m256 zero = _mm256_setzero_ps();
    int64_t g = 0, left = gs; /* the group of feature k0, and its features from k0 on */
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        int64_t g0 = g, left0 = left;
        for (int j = 0; j < 4; j++) {
            g = g0, left = left0;
            for (int64_t k = 0; k < kc; k += 32) {
                qprefetch(pf);
                __m256 w[4];
                fp8x32(wr[j] + k0 + k, w);
                __m256 s = _mm256_set1_ps(sr[j][g] * 0x1p40f);
                for (int v = 0; v < 4; v++)
                    _mm256_storeu_ps(wf + j * KC + k + 8 * v, _mm256_fmadd_ps(w[v], s, zero));
                if ((left -= 32) == 0) g++, left = gs;
            }
        }
        for (int64_t m = 0, p = 0; m < M; m += 2, p++) {
            const float* x0 = xf + m * K + k0;
            const float* x1 = m + 1 < M ? x0 + K : x0;
#ifdef __AVX512F__
            /* 16 features per FMA (two issue a cycle on Sapphire Rapids-class cores), fresh
               sums per chunk folded into Acc's 256-bit halves */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < kc; k += 16) {
                if ((k & 31) == 0) qprefetch(pf);
                __m512 u = _mm512_loadu_ps(x0 + k), v = _mm512_loadu_ps(x1 + k), w;
                w = _mm512_loadu_ps(wf + k);
                a0 = _mm512_fmadd_ps(w, u, a0), b0 = _mm512_fmadd_ps(w, v, b0);
                w = _mm512_loadu_ps(wf + KC + k);
                a1 = _mm512_fmadd_ps(w, u, a1), b1 = _mm512_fmadd_ps(w, v, b1);
                w = _mm512_loadu_ps(wf + 2 * KC + k);
                a2 = _mm512_fmadd_ps(w, u, a2), b2 = _mm512_fmadd_ps(w, v, b2);
                w = _mm512_loadu_ps(wf + 3 * KC + k);
                a3 = _mm512_fmadd_ps(w, u, a3), b3 = _mm512_fmadd_ps(w, v, b3);
            }
            __m512 as[4] = {a0, a1, a2, a3}, bs[4] = {b0, b1, b2, b3};
            for (int j = 0; j < 4; j++) {
                acc[p].v[j][0] = _mm256_add_ps(acc[p].v[j][0], fold512ps(as[j]));
                acc[p].v[j][1] = _mm256_add_ps(acc[p].v[j][1], fold512ps(bs[j]));
            }
#else
            /* named accumulators (an array of them stayed in memory) */
            __m256 a0 = acc[p].v[0][0], a1 = acc[p].v[1][0], a2 = acc[p].v[2][0],
                   a3 = acc[p].v[3][0];
            __m256 b0 = acc[p].v[0][1], b1 = acc[p].v[1][1], b2 = acc[p].v[2][1],
                   b3 = acc[p].v[3][1];
            for (int64_t k = 0; k < kc; k += 8) {
                if ((k & 31) == 0) qprefetch(pf); /* the next blocks, during every pass */
                __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k), w;
                w = _mm256_loadu_ps(wf + k);
                a0 = _mm256_fmadd_ps(w, u, a0), b0 = _mm256_fmadd_ps(w, v, b0);
                w = _mm256_loadu_ps(wf + KC + k);
                a1 = _mm256_fmadd_ps(w, u, a1), b1 = _mm256_fmadd_ps(w, v, b1);
                w = _mm256_loadu_ps(wf + 2 * KC + k);
                a2 = _mm256_fmadd_ps(w, u, a2), b2 = _mm256_fmadd_ps(w, v, b2);
                w = _mm256_loadu_ps(wf + 3 * KC + k);
                a3 = _mm256_fmadd_ps(w, u, a3), b3 = _mm256_fmadd_ps(w, v, b3);
            }
            acc[p].v[0][0] = a0, acc[p].v[1][0] = a1, acc[p].v[2][0] = a2, acc[p].v[3][0] = a3;
            acc[p].v[0][1] = b0, acc[p].v[1][1] = b1, acc[p].v[2][1] = b2, acc[p].v[3][1] = b3;
#endif
        }
    }
}

/* sum over groups of scale * zero * xsum[m], per (weight row j, input row m), into the
   partial-sum vectors (negated), so the final horizontal sum takes it along. */
static inline void zero_points(const float* const* sr, const uint8_t* const* zr, const float* xsum,
                               int64_t m, int MR, int64_t G, Acc* acc) {
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < MR; i++) {
            const float* xs = xsum + (m + i) * G;
            int64_t g = 0;
            __m256 c = _mm256_setzero_ps();
            for (; g + 8 <= G; g += 8) {
                __m256 z = _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(zr[j] + g))));
                c = _mm256_fmadd_ps(_mm256_mul_ps(z, _mm256_loadu_ps(sr[j] + g)),
                                    _mm256_loadu_ps(xs + g), c);
            }
            float tail = 0;
            for (; g < G; g++) tail += sr[j][g] * (float)zr[j][g] * xs[g];
            c = _mm256_add_ps(c, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
            acc->v[j][i] = _mm256_sub_ps(acc->v[j][i], c);
        }
}

/* One block against one input row, or (many) against all of them. Every call below has
   constant arguments, so each is compiled for its kind (the parallel region's body is
   outlined, where a kind passed down would reach the loops as a variable). */
static void run_block(int kind, int many, const int16_t* xq, const float* xf,
                      const uint8_t* const* wr, const float* const* sr, int64_t m, int64_t M,
                      int64_t K, int64_t gs, Prefetch* pf, void* scratch, Acc* acc) {
    if (many) {
        switch (kind) {
        case Q_U8: block_int_many(Q_U8, xq, wr, sr, M, K, gs, pf, scratch, acc); break;
        case Q_U4: block_int_many(Q_U4, xq, wr, sr, M, K, gs, pf, scratch, acc); break;
        case Q_U4W: block_int_many(Q_U4W, xq, wr, sr, M, K, gs, pf, scratch, acc); break;
        default: block_fp8_many(xf, wr, sr, M, K, gs, pf, scratch, acc);
        }
        return;
    }
    int two = M - m >= 2;
    switch (kind * 2 + two) {
    case Q_U8 * 2: block_int(Q_U8, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4 * 2: block_int(Q_U4, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4W * 2: block_int(Q_U4W, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U8 * 2 + 1: block_int2(Q_U8, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4 * 2 + 1: block_int2(Q_U4, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4W * 2 + 1: block_int2(Q_U4W, xq, wr, sr, m, K, gs, pf, acc); break;
    default:
        if (M - m >= 2) block_fp8(2, xf, wr, sr, m, K, gs, pf, acc);
        else block_fp8(1, xf, wr, sr, m, K, gs, pf, acc);
    }
}

static void qgemv_kind(
    int kind, const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
    const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
    int64_t M, int64_t N, int64_t K, int64_t gs) {
    int64_t G = K / gs;
    int16_t* xq = NULL;
    float *xf = NULL, *xscale = NULL, *xsum = NULL;
    int* xexp = NULL;
    if (kind == Q_FP8) {
        xf = (float*)malloc(sizeof(float) * M * K);
        xexp = (int*)malloc(sizeof(int) * M);
    } else {
        xq = (int16_t*)malloc(sizeof(int16_t) * M * K);
        xscale = (float*)malloc(sizeof(float) * M);
        xsum = (float*)malloc(sizeof(float) * M * G);
    }
    int64_t blocks = (N + 3) / 4;
    /* One or two rows: codes turned into numbers in registers, per pass; more: once per
       block (integer codes into a scratch per segment, block_int_many; fp8 to fp32 with its
       scales, block_fp8_many) and every pass over that scratch. */
    int many = M > 2;
    int64_t steps = kind == Q_FP8 ? K / 32 * ((M + 1) / 2 + (many ? 4 : 0))
                                  : (many ? K / step_features(kind) * 4 + K / 32 * ((M + 1) / 2)
                                          : K / step_features(kind) * (M == 2 ? 2 : 1));
    #pragma omp parallel
    {
        /* fp8's weights are fp32 subnormals where their codes are (fp8x32): a thread that
           treats subnormal inputs as zero (MXCSR's DAZ, torch.set_flush_denormal) would drop
           them, so it is cleared here and restored at the end */
        unsigned int csr = _mm_getcsr();
        if (kind == Q_FP8) _mm_setcsr(csr & ~0x0040u);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (kind == Q_FP8) convert_x(x, x_bf16, m, K, xf, xexp);
            else quantize_x(kind, x, x_bf16, m, K, gs, xq, xscale, xsum);
        }
        /* fp8: [4][KC] fp32; integer codes: [4][SEG] int16 */
        void* scratch = many ? aligned_alloc(64, kind == Q_FP8 ? sizeof(float) * 4 * KC
                                                               : sizeof(int16_t) * 4 * SEG)
                             : NULL;
        Acc* accs = many ? (Acc*)aligned_alloc(64, sizeof(Acc) * ((M + 1) / 2)) : NULL;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t n0 = b * 4;
            int rows = N - n0 < 4 ? (int)(N - n0) : 4;
            const uint8_t* wr[4];
            const float* sr[4];
            const uint8_t* zr[4];
            for (int j = 0; j < 4; j++) {
                int64_t r = n0 + (j < rows ? j : 0);
                wr[j] = codes + r * cstride;
                sr[j] = scales + r * gstride;
                zr[j] = zeros ? zeros + r * gstride : NULL;
            }
            int64_t block_bytes = 4 * cstride;
            Prefetch pf = {ahead(codes + n0 * cstride, block_bytes, n0 + 4 * PF_BLOCKS < N),
                           block_bytes / 64, steps, 0, 0};
            if (many) run_block(kind, 1, xq, xf, wr, sr, 0, M, K, gs, &pf, scratch, accs);
            for (int64_t m = 0; m < M; m += 2) {
                Acc one;
                Acc* acc = many ? &accs[m / 2] : &one;
                int mr = M - m >= 2 ? 2 : 1;
                if (!many) run_block(kind, 0, xq, xf, wr, sr, m, M, K, gs, &pf, NULL, acc);
                if (kind != Q_FP8 && zeros) zero_points(sr, zr, xsum, m, mr, G, acc);
                for (int i = 0; i < mr; i++) {
                    __m128 t = hsum4(acc->v[0][i], acc->v[1][i], acc->v[2][i], acc->v[3][i]);
                    float out[4];
                    _mm_storeu_ps(out, t);
                    /* fp8: the weights' 2^-120, the 2^40 of the many-row path and x's power of
                       two undone, in double (the factor alone may pass fp32's range) */
                    double f = kind == Q_FP8 ? ldexp(1.0, (many ? 80 : 120) - xexp[m + i])
                                             : (double)xscale[m + i];
                    for (int j = 0; j < rows; j++)
                        store(y, (m + i) * N + n0 + j, (float)(out[j] * f), out_bf16);
                }
            }
        }
        free(scratch);
        free(accs);
        _mm_setcsr(csr);
    }
    free(xq);
    free(xf);
    free(xexp);
    free(xscale);
    free(xsum);
}

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (fp32, or bf16 where x_bf16) @ W.T; W's
   row n has its codes at codes + n * cstride, its groups' scales (zero points) at
   scales (zeros) + n * gstride. */
void qgemv_u8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
              int64_t M, int64_t N, int64_t K, int64_t gs) {
    qgemv_kind(Q_U8, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N, K,
               gs);
}
void qgemv_u4(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
              int64_t M, int64_t N, int64_t K, int64_t gs) {
    if (gs % 64 == 0)
        qgemv_kind(Q_U4, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N,
                   K, gs);
    else
        qgemv_kind(Q_U4W, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M,
                   N, K, gs);
}
void qgemv_fp8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
               const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
               int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    qgemv_kind(Q_FP8, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N, K,
               gs);
}

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
