/* Matmuls over quantized weights (minisgl/quant/qtensor.py's layout), each code byte read once
   per call from memory and turned into numbers in registers or an L1 scratch, never into a
   dequantized copy of the weight:

     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k] - zero[n, g] * xsum[m, g])

   Groups are contiguous runs of `gs` input features (gs % 32 == 0, K % gs == 0; 8-bit codes
   also gs == 16, K % 32 == 0: block_int_g16).

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

   Blocks of 4 weight rows are shared among the threads (common.h's share_next); the next
   blocks are prefetched across every pass a block takes (common.h), as the bf16 GEMV does.
   One input row: codes extracted in registers, 4 weight rows at once; with AVX512-VNNI
   integer codes are multiplied as the bytes they are (block_bytes: x split into a high and a
   low byte, VPDPBUSD, the same exact integer sums; one row at 97-106% of one thread's read
   rate for 8-bit codes, 84-95% for 4-bit, Qwen3-0.6B/8B shapes, Sapphire Rapids-class Xeon
   under KVM, cold weights, CPU time on a loaded machine; the int16 path: 68-92%, 63-85%).
   8-bit codes read a block's rows a chunk of one row at a time (block_bytes_u8_runs: one
   stream, 1.07-1.2x the rate on an AMD EPYC Zen 4, 1 thread, cold), and 2-16 rows of x take
   the byte path too (block_bytes_u8_many, block_bytes_u4_many). 4-bit codes read in runs the same way took
   1.3-1.5x the time there (each 64-byte step is a group of 128 and ends a chunk: the 4 rows'
   interleaved chunks overlap better). Two: integer codes extracted in registers two weight
   rows at a time (4x2 accumulators with the codes and x spill AVX2's 16 registers), fp8 pairs
   in registers; in the AVX2 build integer codes take that path for up to INT_PAIRS_MAX rows,
   fp8 codes for up to FP8_PAIRS_MAX, a pair at a time. More: each code is turned into numbers once per block, integer codes
   into an int16 scratch per segment of <= 512 features, fp8 into fp32 with its scales, and
   every pair of input rows runs over the scratch (in L1) with loads and multiply-adds only.

   What bounds it with AVX2 on the 2-core AMD EPYC VM measured here (avx2 fma f16c; CPUID
   family 23 model 1, QEMU's "EPYC" model, so the host generation is hidden, but its rates
   are Zen 1's: 256-bit VPMADDWD, VPMADDUBSW and shifts issue one per 2 cycles, FMA and
   VPSHUFB one a cycle, VPAND ~2; dependent adds read a 2-3 GHz clock, with the machine's
   load): the one integer-multiply pipe, 16 int16 products per 2 cycles (as many as FMA's 8
   a cycle), and the ops around the products. Per weight row, one input row: 8-bit 6 ops per
   32 codes (2 VPMADDWD), 4-bit 14 per 64 (4; 13 in block_u4) plus 3 per group, fp8 13 per
   32 (4 FMAs). 8- and 4-bit codes alike run at ~12 G a second per core, 50-75% of the
   multiplier's bound: 8-bit streams ~80% of the read rate at 2 threads, 4-bit ~40%. 4-bit at
   75% would need more int16 products per cycle than VPMADDWD gives (VPMADDUBSW on x split
   into bytes: as many multiplies plus widening, measured no faster; bit planes or lookups:
   more ops), or x in fewer bits. From 2 rows on the same bound, 8 products a cycle as bf16's
   FMAs: 8-bit rows cost about what bf16 rows do, and 8 rows at least ~3.5x one row's time.
   Also measured: the kind is a constant in every loop; no prefetch at all saves ~5% hot (its
   credit loop 1-3%: qprefetch_row), but prefetching each row's line at the same offset of the
   block ahead instead (as block_bytes does) took 1.4x (4-bit) to 1.9x (8-bit) the time cold:
   the lines in memory order matter.
   AVX512-VNNI (VPDPWSSD, the AVX-512 build) fuses a VPMADDWD and its VPADDD. x is quantized
   (converted) row by row inside the same parallel region, so a call wakes the threads once. */
#include "common.h"
#include "fp8.h"

#include <cpuid.h>

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

/* One input row's step (block_int, block_u4, block_fp8) in the AVX2 build: where a block's
   lines are twice its steps (its rows' codes contiguous: 8-bit, 4-bit in groups of 64 or
   more, fp8), Prefetch's credits come to exactly two lines a step, issued here without the
   credit loop: the same lines in the same order, 0.97-0.99x the time (int8, int4). */
#ifndef __AVX512F__
static inline void qprefetch_row(Prefetch* p, int two) {
    if (!two) {
        qprefetch(p);
        return;
    }
    if (!p->base) return;
    const char* at = p->base + 64 * p->issued;
    _mm_prefetch(at, _MM_HINT_T0);
    _mm_prefetch(at + 64, _MM_HINT_T0);
    p->issued += 2;
}
#else
#define qprefetch_row(p, two) ((void)(two), qprefetch(p))
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

/* Codes of features 0-31 as evens e0 (0-15 of them) and e1, odds o0 and o1 -> out[s] holds
 * features 4l+s (int4's order): a second round of even/odd. */
static inline void store_quad_order(__m256i* out, __m256i e0, __m256i o0, __m256i e1, __m256i o1) {
    __m256i s0, s1, s2, s3;
    split_even_odd(e0, e1, &s0, &s2);
    split_even_odd(o0, o1, &s1, &s3);
    _mm256_storeu_si256(out, s0);
    _mm256_storeu_si256(out + 1, s1);
    _mm256_storeu_si256(out + 2, s2);
    _mm256_storeu_si256(out + 3, s3);
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

/* 32 bf16 features -> int16 codes of the even features and of the odd ones, each in feature
   order (the 8-bit layout's two vectors), rounded and clamped as codes16; their sum into *sum.
   A bf16 pair fills a 32-bit lane: the odd feature's fp32 is the lane masked, the even one's
   its low half moved up (VPSHUFB), all within 128-bit lanes but for one VPERMQ per output.
   Widening with VPMOVZXWD and a shift, then splitting the codes into evens and odds
   (split_even_odd's VPERMQ and VPERM2I128, several uops each on Zen 1 class cores), took
   ~2.5x the time: 1.6 us for a 3072-feature row, a B=1 call's serial part (one thread
   quantizes x while the other waits). The same codes and sums bit for bit. */
static inline void codes_even_odd_bf16(const uint16_t* p, __m256 inv, __m256i* sum,
                                       __m256i* even, __m256i* odd) {
    const __m256i up = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13,
                                        -1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
    __m256i v0 = _mm256_loadu_si256((const __m256i*)p);
    __m256i v1 = _mm256_loadu_si256((const __m256i*)(p + 16));
    __m256 f[4] = {_mm256_castsi256_ps(_mm256_shuffle_epi8(v0, up)),
                   _mm256_castsi256_ps(_mm256_shuffle_epi8(v1, up)),
                   _mm256_castsi256_ps(_mm256_and_si256(v0, high)),
                   _mm256_castsi256_ps(_mm256_and_si256(v1, high))};
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));
        c[i] = _mm256_max_epi32(_mm256_min_epi32(c[i], top), bottom);
    }
    *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                                   _mm256_add_epi32(c[2], c[3])));
    *even = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    *odd = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
}

/* max|x| of a bf16 row: its bit patterns without the sign compared as integers (they order as
   the magnitudes do), no conversions. */
static float amax_bf16(const uint16_t* xb, int64_t K) {
    const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
    __m256i a = _mm256_setzero_si256(), b = a;
    for (int64_t k = 0; k < K; k += 32) {
        a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(xb + k)),
                                                 abs_mask));
        b = _mm256_max_epu16(b, _mm256_and_si256(
                                    _mm256_loadu_si256((const __m256i*)(xb + k + 16)), abs_mask));
    }
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i*)lanes, _mm256_max_epu16(a, b));
    uint16_t top = 0;
    for (int i = 0; i < 16; i++) top = lanes[i] > top ? lanes[i] : top;
    return bf16_to_f32(top);
}

/* x row m -> int16 codes in `kind`'s layout, its scale, and per-group integer sums. */
/* x row m's quantization step: max|x| / XMAX (1 where x is all zeros). */
static float x_step(const void* x, int x_bf16, int64_t m, int64_t K) {
    const float* xf = (const float*)x + m * K;
    const uint16_t* xb = (const uint16_t*)x + m * K;
    if (x_bf16) {
        float amax = amax_bf16(xb, K);
        return amax > 0 ? amax / XMAX : 1.0f;
    }
    /* four chains (K % 32 == 0): one waited on the max's latency every 8 features */
    __m256 mx[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t k = 0; k < K; k += 32)
        for (int i = 0; i < 4; i++) {
            __m256 v = x_bf16 ? load_bf16(xb + k + 8 * i) : _mm256_loadu_ps(xf + k + 8 * i);
            mx[i] = _mm256_max_ps(mx[i], _mm256_and_ps(v, abs_mask));
        }
    __m256 amax8 = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
    __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
    a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
    float amax = _mm_cvtss_f32(a4);
    return amax > 0 ? amax / XMAX : 1.0f;
}

/* x row m's step of features from k, quantized by inv into int16 codes in `kind`'s layout at
   q + k; their sum into sum8. */
static inline void quantize_step(int kind, const float* xf, const uint16_t* xb, int x_bf16,
                                 int64_t k, __m256 inv, __m256i* sum8, int16_t* q) {
    __m256i* out = (__m256i*)(q + k);
    if (x_bf16) {
        __m256i e0, o0;
        codes_even_odd_bf16(xb + k, inv, sum8, &e0, &o0);
        if (kind != Q_U4) {
            _mm256_storeu_si256(out, e0);
            _mm256_storeu_si256(out + 1, o0);
            return;
        }
        __m256i e1, o1;
        codes_even_odd_bf16(xb + k + 32, inv, sum8, &e1, &o1);
        store_quad_order(out, e0, o0, e1, o1);
        return;
    }
    const int S = step_features(kind);
    __m256i c[4];
    for (int v = 0; v < S / 16; v++) {
        int64_t at = k + 16 * v;
        c[v] = codes16(_mm256_loadu_ps(xf + at), _mm256_loadu_ps(xf + at + 8), inv, sum8);
    }
    if (kind == Q_U4) {
        __m256i e0, o0, e1, o1;
        split_even_odd(c[0], c[1], &e0, &o0);
        split_even_odd(c[2], c[3], &e1, &o1);
        store_quad_order(out, e0, o0, e1, o1);
    } else {
        __m256i e, o;
        split_even_odd(c[0], c[1], &e, &o);
        _mm256_storeu_si256(out, e);
        _mm256_storeu_si256(out + 1, o);
    }
}

static int32_t sum_lanes(__m256i sum8) {
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i*)lanes, sum8);
    int32_t sum = 0;
    for (int j = 0; j < 8; j++) sum += lanes[j];
    return sum;
}

static void quantize_x(int kind, const void* x, int x_bf16, int64_t m, int64_t K, int64_t gs,
                       int16_t* xq, float* xscale, float* xsum) {
    const float* xf = (const float*)x + m * K;
    const uint16_t* xb = (const uint16_t*)x + m * K;
    float s = x_step(x, x_bf16, m, K);
    xscale[m] = s;
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    int16_t* q = xq + m * K;
    int64_t G = K / gs;
    const int S = step_features(kind);
    if (gs < S) { /* 8-bit codes in groups of 16: a step is two groups, each summed apart */
        __m256i unused = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += S) {
            quantize_step(kind, xf, xb, x_bf16, k, inv, &unused, q);
            int32_t lo = 0, hi = 0; /* evens then odds: features 0-15 are each's first 8 */
            for (int i = 0; i < 8; i++) {
                lo += q[k + i] + q[k + 16 + i];
                hi += q[k + 8 + i] + q[k + 24 + i];
            }
            xsum[m * G + k / 16] = (float)lo;
            xsum[m * G + k / 16 + 1] = (float)hi;
        }
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        __m256i sum8 = _mm256_setzero_si256();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += S) /* steps never cross groups */
            quantize_step(kind, xf, xb, x_bf16, k, inv, &sum8, q);
        xsum[m * G + g] = (float)sum_lanes(sum8);
    }
}

/* x row m -> fp32 in fp8's layout, times 2^xexp[m] (a power of two that brings max|x| near
   2^64: the weights' fp32 forms are their values times 2^-120, see fp8x32, and their products
   with x must stay clear of the subnormal range). */
/* 32 bf16 features times p into fp8's layout (x_slot: features 4q, 4q+2, 4q+1, 4q+3): the
   even features' fp32 by VPSHUFB and the odd ones' by a mask (as codes_even_odd_bf16), then
   each pair of those split by VSHUFPS and put in order by one VPERMQ. The scalar loop this
   replaces took ~7 us for a 3072-feature row, the serial part of every fp8 call at one row
   (the other thread waits). */
static inline void fp8_x32_bf16(const uint16_t* b, __m256 p, float* out) {
    const __m256i up = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13,
                                        -1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i v0 = _mm256_loadu_si256((const __m256i*)b);
    __m256i v1 = _mm256_loadu_si256((const __m256i*)(b + 16));
    __m256 e0 = _mm256_castsi256_ps(_mm256_shuffle_epi8(v0, up)); /* x0, x2, .. x14 */
    __m256 e1 = _mm256_castsi256_ps(_mm256_shuffle_epi8(v1, up)); /* x16, .. x30 */
    __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));  /* x1, x3, .. x15 */
    __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
    __m256 part[4] = {_mm256_shuffle_ps(e0, e1, 0x88), _mm256_shuffle_ps(e0, e1, 0xDD),
                      _mm256_shuffle_ps(o0, o1, 0x88), _mm256_shuffle_ps(o0, o1, 0xDD)};
    for (int i = 0; i < 4; i++) { /* part[i]'s 64-bit pairs hold q = 0, 4, 2, 6 (x 2) */
        __m256 v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(part[i]), 0xD8));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(v, p));
    }
}

static void convert_x(const void* x, int x_bf16, int64_t m, int64_t K, float* xf, int* xexp) {
    const float* f = (const float*)x + m * K;
    const uint16_t* b = (const uint16_t*)x + m * K;
    float amax = 0;
    if (x_bf16) {
        amax = amax_bf16(b, K);
    } else {
        for (int64_t k = 0; k < K; k++) {
            float v = fabsf(f[k]);
            amax = v > amax ? v : amax;
        }
    }
    int e = 0;
    if (amax > 0 && isfinite(amax)) frexpf(amax, &e);
    xexp[m] = 64 - e;
    float p = ldexpf(1.0f, 64 - e);
    if (x_bf16) { /* K % 32 == 0 (fp8 groups are) */
        for (int64_t k = 0; k < K; k += 32) fp8_x32_bf16(b + k, _mm256_set1_ps(p), xf + m * K + k);
        return;
    }
    for (int64_t k = 0; k < K; k++) xf[m * K + x_slot(Q_FP8, k)] = f[k] * p;
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

/* 32 e4m3 bytes -> four vectors of 8 fp32: their values times 2^-120, exactly (subnormals
   too, as fp32 subnormals), in x's order (features 4q, 4q+2, 4q+1, 4q+3). No F16C: a 16-bit
   lane holds two codes, and each becomes the top half of an fp32 (a bf16) by a shift and a
   mask: its sign stays at bit 15, its exponent and mantissa move to bits 10..4, so the fp32
   exponent field is the code's own (bias 7 read as 127) and its mantissa the code's three
   bits. Then, as the bf16 GEMV does, a 32-bit lane's two halves become two fp32 by a shift
   and a mask. 9 single-cycle ops per 32 codes where VCVTPH2PS took 2 uops per 8 on Zen 3. */
static inline __attribute__((always_inline)) void fp8x32(const uint8_t* p, __m256* w,
                                                          int by_shuffle) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p);
    const __m256i keep = _mm256_set1_epi16((short)0x87F0);
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i odd = _mm256_and_si256(_mm256_srai_epi16(v, 4), keep), even;
#ifndef __AVX512F__
    if (by_shuffle) {
        /* byte moves as VPSHUFB (low byte or word of each lane up), not shifts: the same
           bits, and Zen 1 class cores shift on one pipe, shuffle on two (fp8 one row 0.95x,
           many rows 0.97x the time; two rows, where the two masks spill a register: 1.03x) */
        const __m256i up8 = _mm256_setr_epi8(-1, 0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1, 12,
                                             -1, 14, -1, 0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10,
                                             -1, 12, -1, 14);
        const __m256i up16 = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1,
                                              12, 13, -1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9,
                                              -1, -1, 12, 13);
        even = _mm256_and_si256(_mm256_srai_epi16(_mm256_shuffle_epi8(v, up8), 4), keep);
        w[0] = _mm256_castsi256_ps(_mm256_shuffle_epi8(even, up16));
        w[2] = _mm256_castsi256_ps(_mm256_shuffle_epi8(odd, up16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(even, hi));
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, hi));
        return;
    }
#endif
    (void)by_shuffle;
    even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), keep);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(even, 16));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(odd, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(even, hi));
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
    const int two = pf->lines == 2 * pf->steps;
    __m256 c[4]; /* in registers: acc's slots, behind a pointer, were reloaded every flush */
    for (int j = 0; j < 4; j++) c[j] = _mm256_setzero_ps();
    for (int64_t c0 = 0, g = 0, end; c0 < K; c0 = end, g += end == (g + 1) * gs) {
        end = (g + 1) * gs < c0 + FLUSH ? (g + 1) * gs : c0 + FLUSH;
        __m256i a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_si256();
        for (int64_t k = c0; k < end; k += S) {
            qprefetch_row(pf, two);
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
            c[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j]), _mm256_broadcast_ss(sr[j] + g), c[j]);
    }
    for (int j = 0; j < 4; j++) acc->v[j][0] = c[j];
}

/* block_int for 8-bit codes in groups of 16 (GGUF's Q6_K, Q3_K, Q2_K, where the build has no
   VNNI panels) against input rows m .. m + MR - 1 (MR 1 or 2), into acc columns i .. i + MR - 1: a
   step's 32 features are two groups, and its int32 lanes 0-3 hold the first one's products
   (features 4l..4l+3 in lane l: the evens' and odds' pairs), lanes 4-7 the second's, so each
   step is flushed with the two scales spread over the lanes. A pair of rows shares a step's
   extracted codes and scales (each row's sums and roundings as it has alone). */
static inline __attribute__((always_inline)) void block_int_g16(
    int MR, const int16_t* xq, const uint8_t* const* wr, const float* const* sr, int64_t m,
    int i, int64_t K, Prefetch* pf, Acc* acc) {
    const int16_t* x0 = xq + m * K;
    const int16_t* x1 = MR == 2 ? x0 + K : x0;
    const int two = pf->lines == 2 * pf->steps;
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 c0[4], c1[4]; /* in registers: acc's slots are reloaded and stored every step */
    for (int j = 0; j < 4; j++) c0[j] = c1[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        qprefetch_row(pf, two);
        const __m256i xe = _mm256_loadu_si256((const __m256i*)(x0 + k));
        const __m256i xo = _mm256_loadu_si256((const __m256i*)(x0 + k + 16));
        const __m256i ye = _mm256_loadu_si256((const __m256i*)(x1 + k));
        const __m256i yo = _mm256_loadu_si256((const __m256i*)(x1 + k + 16));
        for (int j = 0; j < 4; j++) {
            __m256i e[4];
            extract(Q_U8, wr[j] + k, e);
            __m128 pair = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(sr[j] + k / 16)));
            __m256 scales = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), halves);
            __m256i a = DOT16(DOT16(_mm256_setzero_si256(), e[0], xe), e[1], xo);
            c0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scales, c0[j]);
            if (MR == 2) {
                __m256i b = DOT16(DOT16(_mm256_setzero_si256(), e[0], ye), e[1], yo);
                c1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scales, c1[j]);
            }
        }
    }
    for (int j = 0; j < 4; j++) {
        acc->v[j][i] = c0[j];
        if (MR == 2) acc->v[j][i + 1] = c1[j];
    }
}

#ifndef __AVX512F__
/* block_int for 4-bit codes in groups of 256 or more (Q_U4), AVX2 build: two of a lane's four
   nibbles are multiplied where they lie, 16 times their value (v & 0xF0, (v >> 4) & 0xF0), into
   a second set of sums that is divided by 16 (exactly: each product is a multiple of 16) when
   the chunk ends, so a step takes 13 vector ops per weight row instead of 14 (one shift fewer)
   and a chunk two more (the shift and add that join the sums): a gain from 4 steps a chunk on,
   where ops, not a pipe, bound the loop (see the top). Same integer sums, so the same results
   bit for bit. Per lane the 16x sums reach at most FLUSH / 64 steps of 2 * 2 * 240 * 32767
   (< 2^29 at FLUSH 1024). 1 row, 1 thread, weights in L2: gs 256 0.97x, gs 1024 0.94x the
   time of block_int (AMD EPYC, Zen 1 class under KVM, avx2 fma). */
/* Rows w0..w3's features [k0, end) against x0: the sums a (nibbles 0, 3) and b (1, 2, times
   16), and their exact total per row into sums. */
static inline __attribute__((always_inline)) void u4_chunk(
    const int16_t* x0, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,
    const uint8_t* w3, int64_t k0, int64_t end, Prefetch* pf, int two, __m256i* sums) {
    const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = k0; k < end; k += 64) {
        qprefetch_row(pf, two);
        const __m256i* xv = (const __m256i*)(x0 + k);
#define U4_ROW(a, b, p)                                                                    \
    {                                                                                      \
        __m256i v = _mm256_loadu_si256((const __m256i*)(p + k / 2));                       \
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_and_si256(v, low),                \
                                                  _mm256_loadu_si256(xv)));                \
        KEEP(a);                                                                           \
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_srli_epi16(v, 12),                \
                                                  _mm256_loadu_si256(xv + 3)));            \
        KEEP(a);                                                                           \
        b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_and_si256(v, high),               \
                                                  _mm256_loadu_si256(xv + 1)));            \
        KEEP(b);                                                                           \
        b = _mm256_add_epi32(b, _mm256_madd_epi16(                                         \
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), high),       \
                                    _mm256_loadu_si256(xv + 2)));                          \
        KEEP(b);                                                                           \
    }
        U4_ROW(a0, b0, w0)
        U4_ROW(a1, b1, w1)
        U4_ROW(a2, b2, w2)
        U4_ROW(a3, b3, w3)
#undef U4_ROW
    }
    /* the exact integer sums: b is a multiple of 16 */
    sums[0] = _mm256_add_epi32(a0, _mm256_srai_epi32(b0, 4));
    sums[1] = _mm256_add_epi32(a1, _mm256_srai_epi32(b1, 4));
    sums[2] = _mm256_add_epi32(a2, _mm256_srai_epi32(b2, 4));
    sums[3] = _mm256_add_epi32(a3, _mm256_srai_epi32(b3, 4));
}

static inline __attribute__((always_inline)) void block_u4(
    const int16_t* xq, const uint8_t* const* wr, const float* const* sr, int64_t m, int64_t K,
    int64_t gs, Prefetch* pf, Acc* acc) {
    const int16_t* x0 = xq + m * K;
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    const int two = pf->lines == 2 * pf->steps;
    for (int j = 0; j < 4; j++) acc->v[j][0] = _mm256_setzero_ps();
    for (int64_t c0 = 0, g = 0, end; c0 < K; c0 = end, g += end == (g + 1) * gs) {
        end = (g + 1) * gs < c0 + FLUSH ? (g + 1) * gs : c0 + FLUSH;
        __m256i t[4];
        u4_chunk(x0, w0, w1, w2, w3, c0, end, pf, two, t);
        for (int j = 0; j < 4; j++)
            acc->v[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[j]),
                                           _mm256_broadcast_ss(sr[j] + g), acc->v[j][0]);
    }
}
#endif

/* 4-bit codes against x in 8 bits (qgemv_x8, the user's --cpu-int4-activations int8): x is
   quantized per block of X8_BLOCK features (64 where groups are 32 or 64 long: groups of 32,
   Q4_0 and Q4_K files', two to a block, x8_scales), max|x| / 127 a
   block, rounded to nearest even, as llama.cpp's Q8 activations and vLLM's CPU AWQ/GPTQ
   (IPEX, low-precision mode INT8) do; not exact, so off by default. The codes then meet x
   as bytes: VPMADDUBSW multiplies 32 (unsigned code, signed x) pairs into 16 int16 pair sums
   (at most 2 * 15 * 127 each), summed in int16 over a block (<= 4 * 3810 < 2^15) and widened
   once a block by one VPMADDWD with ones: 2.25 multiplier ops per 64 codes and weight row
   where the int16 path takes 4, so the one multiplier pipe of Zen 1 class cores no longer
   bounds one row (1 thread, weights in L2: 26 against 16 G codes a second). The low nibbles
   of a 32-byte load are the even features of its 64 (qtensor's 4-bit layout), the high ones
   the odd: x per 64 features is its 32 evens, then its 32 odds, one byte each. Each block's
   integer sums become fp32 times scale[n, g] * xscale[block]; the zero points' term takes the
   groups' sums of x in the same scaled units, and the row's xscale is 1. Up to
   qgemv_x8_rows input rows (decode batches), a row at a time or in pairs whose codes are
   extracted once in registers for both rows (a scratch written once per block and read per
   pair, as block_int_many does, measured no faster than the int16 path: its per-block
   widening and scaling outweighed the products saved). */
int qgemv_x8 = 0;
#define X8_BLOCK 128

static inline int64_t x8_block(int64_t gs) { return gs % X8_BLOCK == 0 ? X8_BLOCK : 64; }

/* acc + a step's products: codes e (even features) and o (odd) against x's xe and xo, as int16
   pair sums (VPMADDUBSW: unsigned code, signed x). */
static inline __m256i x8_dot(__m256i acc, __m256i e, __m256i o, __m256i xe, __m256i xo) {
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(e, xe),
                                                   _mm256_maddubs_epi16(o, xo)));
}

/* A block's int16 sums widened (VPMADDWD with ones), to fp32, times `scale`, into sum. */
static inline __m256 x8_flush(__m256i a, __m256 scale, __m256 sum) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a, _mm256_set1_epi16(1))),
                           scale, sum);
}

/* The scales of block b's lanes for a weight row's group scales s, times x's block scale xs:
   its group's; or where groups of 32 halve the 64-feature block (Q4_0 / Q4_K files), group
   2b's in the low 4 lanes (the first 32 features: the low 16 code bytes, whose pair sums
   VPMADDUBSW and VPMADDWD keep in the low half) and group 2b + 1's in the high 4. */
static inline __m256 x8_scales(const float* s, int64_t b, int64_t g, int halves, float xs) {
    if (!halves) return _mm256_set1_ps(s[g] * xs);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s[2 * b] * xs)),
                                _mm_set1_ps(s[2 * b + 1] * xs), 1);
}

/* 64 features of x (bf16 or fp32) at `at` times inv -> their int8 evens and odds (32 each),
   the codes' sum of each 32 into sum[0] and sum[1] (the same sum where they are one). */
static inline void x8_step(const void* x, int x_bf16, int64_t at, __m256 inv, __m256i* sum[2],
                           int8_t* out) {
    __m256i e[2], o[2];
    for (int h = 0; h < 2; h++) {
        if (x_bf16) {
            codes_even_odd_bf16((const uint16_t*)x + at + 32 * h, inv, sum[h], &e[h], &o[h]);
            continue;
        }
        const float* f = (const float*)x + at + 32 * h;
        __m256i c0 = codes16(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), inv, sum[h]);
        __m256i c1 = codes16(_mm256_loadu_ps(f + 16), _mm256_loadu_ps(f + 24), inv, sum[h]);
        split_even_odd(c0, c1, &e[h], &o[h]);
    }
    /* int16 -> int8 (|code| <= 127: no saturation), lanes back in order */
    _mm256_storeu_si256((__m256i*)out,
                        _mm256_permute4x64_epi64(_mm256_packs_epi16(e[0], e[1]), 0xD8));
    _mm256_storeu_si256((__m256i*)(out + 32),
                        _mm256_permute4x64_epi64(_mm256_packs_epi16(o[0], o[1]), 0xD8));
}

/* max|x| over features [k, k + n) of row data x (bf16 or fp32), n % 32 == 0. */
static float x8_amax(const void* x, int x_bf16, int64_t k, int64_t n) {
    if (x_bf16) return amax_bf16((const uint16_t*)x + k, n);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 a = _mm256_setzero_ps(), b = a;
    for (int64_t i = k; i < k + n; i += 16) {
        a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps((const float*)x + i), abs_mask));
        b = _mm256_max_ps(b, _mm256_and_ps(_mm256_loadu_ps((const float*)x + i + 8), abs_mask));
    }
    float lanes[8], top = 0;
    _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    return top;
}

/* x row m -> int8 codes in x8's layout (xq row m: K bytes), a scale per block (xsb row m:
   K / x8_block), the groups' sums of x in the blocks' scaled units (xsum), xscale[m] = 1. */
static void quantize_x8(const void* x, int x_bf16, int64_t m, int64_t K, int64_t gs, int8_t* xq,
                        float* xsb, float* xscale, float* xsum) {
    const int64_t XB = x8_block(gs), B = K / XB, G = K / gs;
    const void* row = x_bf16 ? (const void*)((const uint16_t*)x + m * K)
                             : (const void*)((const float*)x + m * K);
    xscale[m] = 1.0f;
    for (int64_t g = 0; g < G; g++) xsum[m * G + g] = 0.0f;
    for (int64_t b = 0; b < B; b++) {
        float amax = x8_amax(row, x_bf16, b * XB, XB);
        float s = amax > 0 && isfinite(amax) ? amax / 127.0f : 1.0f;
        xsb[m * B + b] = s;
        const __m256 inv = _mm256_set1_ps(1.0f / s);
        /* groups of 32: a sum for each half of the (64-feature) block */
        const int halves = gs < XB;
        __m256i sum8[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i* sums[2] = {&sum8[0], &sum8[halves]};
        for (int64_t k = b * XB; k < (b + 1) * XB; k += 64)
            x8_step(row, x_bf16, k, inv, sums, xq + m * K + k);
        for (int h = 0; h <= halves; h++) {
            int32_t lanes[8], sum = 0;
            _mm256_storeu_si256((__m256i*)lanes, sum8[h]);
            for (int j = 0; j < 8; j++) sum += lanes[j];
            xsum[m * G + (halves ? 2 * b + h : b * XB / gs)] += s * (float)sum;
        }
    }
}

/* One 4-row block of 4-bit codes (groups of 32, or of 64 or more) against input row m in 8
   bits. */
static inline __attribute__((always_inline)) void block_u4x8(
    const int8_t* xq, const float* xsb, const uint8_t* const* wr, const float* const* sr,
    int64_t m, int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const int64_t XB = x8_block(gs), B = K / XB;
    const int8_t* x0 = xq + m * K;
    const float* xs = xsb + m * B;
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    const __m256i nib = _mm256_set1_epi8(15);
    const int two = pf->lines == 2 * pf->steps;
    const int halves = gs < XB; /* two groups a block (x8_scales) */
    const int64_t per = halves ? 1 : gs / XB; /* blocks a group, counted down */
    for (int j = 0; j < 4; j++) acc->v[j][0] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, left = per; b < B; b++) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = b * XB; k < (b + 1) * XB; k += 64) {
            qprefetch_row(pf, two);
            __m256i xe = _mm256_loadu_si256((const __m256i*)(x0 + k));
            __m256i xo = _mm256_loadu_si256((const __m256i*)(x0 + k + 32));
#define X8_ROW(a, p)                                                                        \
    {                                                                                       \
        __m256i v = _mm256_loadu_si256((const __m256i*)(p + k / 2));                        \
        __m256i o = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);                         \
        a = x8_dot(a, _mm256_and_si256(v, nib), o, xe, xo);                                 \
        KEEP(a);                                                                            \
    }
            X8_ROW(a0, w0)
            X8_ROW(a1, w1)
            X8_ROW(a2, w2)
            X8_ROW(a3, w3)
#undef X8_ROW
        }
        __m256i as[4] = {a0, a1, a2, a3};
        for (int j = 0; j < 4; j++)
            acc->v[j][0] = x8_flush(as[j], x8_scales(sr[j], b, g, halves, xs[b]), acc->v[j][0]);
        if (--left == 0) g++, left = per;
    }
}

/* The same for input rows m and m + 1, two weight rows at a time (as block_int2: the 2x2
   int16 sums, both rows' x and the codes of two weight rows fill AVX2's 16 registers): a
   code's byte is extracted once and multiplied by both rows. */
static inline __attribute__((always_inline)) void block_u4x8_2(
    const int8_t* xq, const float* xsb, const uint8_t* const* wr, const float* const* sr,
    int64_t m, int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const int64_t XB = x8_block(gs), B = K / XB;
    const int halves = gs < XB; /* two groups a block (x8_scales) */
    const int64_t per = halves ? 1 : gs / XB;
    const int8_t *x0 = xq + m * K, *x1 = x0 + K;
    const float *xs0 = xsb + m * B, *xs1 = xs0 + B;
    const __m256i nib = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) acc->v[j][0] = acc->v[j][1] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, left = per; b < B; b++) {
        for (int jh = 0; jh < 4; jh += 2) {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
            for (int64_t k = b * XB; k < (b + 1) * XB; k += 64) {
                qprefetch(pf);
                __m256i v = _mm256_loadu_si256((const __m256i*)(wr[jh] + k / 2));
                __m256i f = _mm256_loadu_si256((const __m256i*)(wr[jh + 1] + k / 2));
                __m256i ve = _mm256_and_si256(v, nib);
                __m256i vo = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                __m256i fe = _mm256_and_si256(f, nib);
                __m256i fo = _mm256_and_si256(_mm256_srli_epi16(f, 4), nib);
                __m256i xe = _mm256_loadu_si256((const __m256i*)(x0 + k));
                __m256i xo = _mm256_loadu_si256((const __m256i*)(x0 + k + 32));
                a0 = x8_dot(a0, ve, vo, xe, xo);
                a1 = x8_dot(a1, fe, fo, xe, xo);
                KEEP(a0);
                KEEP(a1);
                xe = _mm256_loadu_si256((const __m256i*)(x1 + k));
                xo = _mm256_loadu_si256((const __m256i*)(x1 + k + 32));
                b0 = x8_dot(b0, ve, vo, xe, xo);
                b1 = x8_dot(b1, fe, fo, xe, xo);
                KEEP(b0);
                KEEP(b1);
            }
            const float *s0 = sr[jh], *s1 = sr[jh + 1];
            acc->v[jh][0] = x8_flush(a0, x8_scales(s0, b, g, halves, xs0[b]), acc->v[jh][0]);
            acc->v[jh][1] = x8_flush(b0, x8_scales(s0, b, g, halves, xs1[b]), acc->v[jh][1]);
            acc->v[jh + 1][0] =
                x8_flush(a1, x8_scales(s1, b, g, halves, xs0[b]), acc->v[jh + 1][0]);
            acc->v[jh + 1][1] =
                x8_flush(b1, x8_scales(s1, b, g, halves, xs1[b]), acc->v[jh + 1][1]);
        }
        if (--left == 0) g++, left = per;
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

/* The vector pair_int multiplies with: 512 bits in the AVX-512 build (32 products per
   VPDPWSSD, which Sapphire Rapids-class cores issue two a cycle: twice the 256-bit form's
   products, 8 rows took ~2x one row's time there), else 256. The scratch and x share one
   layout, so any width multiplies them; the sums fold into Acc's 256-bit halves at the end. */
#ifdef __AVX512F__
typedef __m512i VI;
#define VI_LOAD(p) _mm512_loadu_si512((const void*)(p))
#define VI_ZERO _mm512_setzero_si512()
#ifdef __AVX512VNNI__
#define VI_DOT(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define VI_DOT(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
static inline __m256i vi_fold(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
#else
typedef __m256i VI;
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define VI_ZERO _mm256_setzero_si256()
#define VI_DOT DOT16
static inline __m256i vi_fold(__m256i v) { return v; }
#endif
#define VI_LANES ((int)(sizeof(VI) / 2)) /* int16 per vector */

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
    VI a0 = VI_ZERO, a1 = a0, a2 = a0, a3 = a0;
    VI b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define PAIR_ROW(a, b, j)                                                              \
    {                                                                                  \
        VI w = VI_LOAD(ws + (j) * SEG + k + h);                                        \
        a = VI_DOT(a, w, u);                                                           \
        KEEP(a);                                                                       \
        if (MR == 2) b = VI_DOT(b, w, v);                                              \
        if (MR == 2) KEEP(b);                                                          \
    }
    for (int64_t k = 0; k < n; k += 32) {
        qprefetch(pf);
        for (int h = 0; h < 32; h += VI_LANES) {
            VI u = VI_LOAD(x0 + k + h);
            VI v = MR == 2 ? VI_LOAD(x1 + k + h) : u;
            PAIR_ROW(a0, b0, 0)
            PAIR_ROW(a1, b1, 1)
            PAIR_ROW(a2, b2, 2)
            PAIR_ROW(a3, b3, 3)
        }
    }
#undef PAIR_ROW
    VI as[4] = {a0, a1, a2, a3}, bs[4] = {b0, b1, b2, b3};
    for (int j = 0; j < 4; j++) {
        __m256 s = _mm256_broadcast_ss(sr[j] + g);
        acc->v[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vi_fold(as[j])), s, acc->v[j][0]);
        if (MR == 2)
            acc->v[j][1] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(vi_fold(bs[j])), s, acc->v[j][1]);
    }
}

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
            pair_int(2, xq + m * K + c0, xq + (m + 1) * K + c0, ws, end - c0, pf, sr, g,
                     &acc[m / 2]);
        if (m < M) pair_int(1, xq + m * K + c0, NULL, ws, end - c0, pf, sr, g, &acc[m / 2]);
    }
}

/* The same for fp8 codes against fp32 x (one or two rows), converting in registers. */
static inline __attribute__((always_inline)) void block_fp8(
    int MR, const float* xf, const uint8_t* const* wr, const float* const* sr, int64_t m,
    int64_t K, int64_t gs, Prefetch* pf, Acc* acc) {
    const float* x0 = xf + m * K;
    const float* x1 = MR == 2 ? x0 + K : x0;
    const int two = pf->lines == 2 * pf->steps;
    for (int j = 0; j < 4; j++) acc->v[j][0] = acc->v[j][1] = _mm256_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, g++) {
        /* FMAs only (no VMULPS): Zen 3 multiplies a subnormal weight at full speed in an FMA,
           not in a VMULPS (measured: random codes, 1 in 16 subnormal, 1.9x the time). One
           row: two chains per weight row; two rows: one each (registers). */
        __m256 a0[4], a1[4];
        for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + gs; k += 32) {
            qprefetch_row(pf, two);
            for (int j = 0; j < 4; j++) {
                __m256 w[4];
                fp8x32(wr[j] + k, w, MR == 1);
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
                fp8x32(wr[j] + k0 + k, w, 1);
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

/* One input row with AVX512-VNNI (the AVX-512 build on a CPU that has it): integer codes
   multiplied as the bytes they are, 64 products per VPDPBUSD (u8 x s8, exact int32 sums),
   instead of widened to int16 lanes for VPDPWSSD (32 per op, and the widening's ops on top).
   x is quantized as for the int16 path (the same integers xq), then split into bytes:
   xq = 256 * hi + lo with hi = xq >> 8 in [-128, 127] (signed) and lo = xq & 255 (unsigned).

     8-bit codes w (u8):  w * hi          VPDPBUSD(w, hi)
                          w * lo          VPDPBUSD(lo, w - 128) + 128 * lo
     4-bit codes w (0..15, as u8 and as s8 alike):
                          w * hi          VPDPBUSD(w, hi)
                          w * lo          VPDPBUSD(lo, w)

   so sum_k w * xq = 256 * sum(w * hi) + sum(w * lo), exact in int32 per lane over a chunk of
   at most FLUSH features (each lane holds FLUSH / 16 features' products, |w * xq| < 2^23);
   the 8-bit codes' 128 * sum(lo) depends on x only, so it is summed per chunk when x is
   quantized, per lane, and starts the chunk's lo sums. The same integers as the int16 path, so
   the same results but for the fp32 roundings of the lanes' sums.

   Layout of the bytes of x, per step of S features (one 64-byte load of a row's codes):
   - 8-bit (S = 64): 64 hi bytes, then 64 lo bytes, in feature order;
   - 4-bit (S = 128): the low nibbles of a 64-byte load are the even features, the high
     nibbles the odd ones: hi of the even features, hi of the odd, lo of the even, lo of the
     odd, 64 bytes each.
   Groups at least a step long end chunks as in block_int; shorter groups (32 or 64
   features) fold every step with a scale per lane: lane l of a step's sums holds features
   [l * S / 16, (l + 1) * S / 16) of it (4-bit: of its evens and odds alike), one group's. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QBYTES 1

static inline int bytes_step(int kind) { return kind == Q_U8 ? 64 : 128; }

/* The most rows of x that integer codes multiply as bytes (block_bytes_u8_many,
   block_bytes_u4_many; at most BYTES_ROWS_MAX); more take the int16 scratch path
   (block_int_many). 2-8 rows as bytes: 1.0-1.4x faster than the int16 paths (int8 per
   channel; int4 group 128: 4 rows 1.1-1.5x, 8 rows 1.05-1.25x, 16 rows even; Qwen3-0.6B
   shapes, 1 thread, cold weights, CPU time, AMD EPYC Zen 4, interleaved), and a row's result
   the same bits at any batch size up to it. Tests and benchmarks set 1 to compare. */
#define BYTES_ROWS_MAX 16
int qgemv_bytes_rows = BYTES_ROWS_MAX;

/* Whether one row of x takes the byte path: groups a multiple of a step or a step's divisor
   (a group of 96 would end inside a lane's run of a step: the int16 path takes those). */
static inline int bytes_usable(int kind, int64_t M, int64_t K, int64_t gs) {
    int S = bytes_step(kind);
    int rows = M == 1 || (M <= qgemv_bytes_rows && M <= BYTES_ROWS_MAX);
    return kind != Q_FP8 && rows && K % S == 0 && (gs % S == 0 || S % gs == 0);
}

/* How a row's features are cut into chunks, all `len` long (whole steps): a group at most
   FLUSH long is one chunk (a group shorter than a step: a step of several groups), a longer
   group (a whole row, per channel) its equal parts of at most FLUSH features. */
typedef struct {
    int64_t len;   /* features per chunk */
    int64_t per;   /* chunks per group (gs >= S) */
    int64_t gstep; /* groups per chunk (gs < S) */
} Chunks;

static inline Chunks bytes_chunks(int kind, int64_t gs) {
    int64_t S = bytes_step(kind);
    Chunks c = {S, 1, S / gs};
    if (gs < S) return c;
    c.gstep = 0;
    for (int64_t n = (gs + FLUSH - 1) / FLUSH;; n++) /* ends at n = gs / S at the latest */
        if (gs % n == 0 && gs / n % S == 0) {
            c.len = gs / n, c.per = n;
            return c;
        }
}

/* 128 * the sum of x's low bytes per chunk of len features and lane (xcorr: [K / len][16]),
   x as 8-bit codes' byte path lays it out (q: per step of 64 features the high bytes, then the
   low): per lane, as block_bytes sums, its 4 bytes of each step (lanes of a step may belong
   to different groups). */
static void bytes_xcorr(const uint8_t* q, int64_t K, int64_t len, int32_t* xcorr) {
    for (int64_t c0 = 0; c0 < K; c0 += len) {
        __m512i t = _mm512_setzero_si512();
        for (int64_t k = c0; k < c0 + len; k += 64)
            t = _mm512_dpbusd_epi32(t, _mm512_loadu_si512(q + 2 * k + 64), _mm512_set1_epi8(1));
        _mm512_storeu_si512(xcorr + c0 / len * 16, _mm512_slli_epi32(t, 7));
    }
}

/* x row m -> its bytes in `kind`'s layout (xb row m: 2K bytes), its scale, per-group integer
   sums (as quantize_x) and, for 8-bit codes, 128 * sum(lo) per chunk and lane (xcorr row m:
   [K / 64][16]). */
static void quantize_x_bytes(int kind, const void* x, int x_bf16, int64_t m, int64_t K,
                             int64_t gs, uint8_t* xb, float* xscale, float* xsum,
                             int32_t* xcorr) {
    float s = x_step(x, x_bf16, m, K);
    xscale[m] = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
    uint8_t* q = xb + m * 2 * K;
    int64_t G = K / gs;
    for (int64_t g = 0; g < G; g++) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
            /* round to nearest even and clamp, as codes16 */
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16_x(x, x_bf16, m * K + k), inv));
            v = _mm512_max_epi32(_mm512_min_epi32(v, top), bottom);
            sum = _mm512_add_epi32(sum, v);
            if (kind == Q_U8) {
                uint8_t* at = q + 2 * (k & ~63) + (k & 63);
                _mm_storeu_si128((__m128i*)at, _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 8)));
                _mm_storeu_si128((__m128i*)(at + 64), _mm512_cvtepi32_epi8(v));
            } else { /* the even features are the low dwords of v's qwords */
                uint8_t* at = q + 2 * (k & ~127) + (k & 127) / 2;
                _mm_storel_epi64((__m128i*)at, _mm512_cvtepi64_epi8(_mm512_srai_epi32(v, 8)));
                _mm_storel_epi64((__m128i*)(at + 64),
                                 _mm512_cvtepi64_epi8(_mm512_srli_epi64(v, 40)));
                _mm_storel_epi64((__m128i*)(at + 128), _mm512_cvtepi64_epi8(v));
                _mm_storel_epi64((__m128i*)(at + 192),
                                 _mm512_cvtepi64_epi8(_mm512_srli_epi64(v, 32)));
            }
        }
        xsum[m * G + g] = (float)_mm512_reduce_add_epi32(sum);
    }
    if (kind == Q_U8) bytes_xcorr(q, K, bytes_chunks(kind, gs).len, xcorr + m * (K / 64) * 16);
}

/* The high nibble of each byte moved down, 4-bit codes' odd features: with GFNI one
   GF2P8AFFINEQB (bit i of each result byte = bit i + 4 of the code byte) instead of a shift and
   a mask, one op of the few the 512-bit ports issue per code byte (int4 1 row, hot weights:
   0.92x the time). Written as assembly, so that the build needs no -mgfni: qgemv_kind runs it
   where CPUID says GFNI (qgemv_gfni). */
static inline __m512i high_nibbles(__m512i w, int gfni) {
    if (!gfni) return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15));
    const __m512i down4 = _mm512_set1_epi64(0x1020408000000000ll); /* rows: bits 4-7, then 0s */
    __m512i o;
    __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=v"(o) : "v"(w), "v"(down4));
    return o;
}

/* Whether the CPU has GFNI (CPUID leaf 7, ECX bit 8). */
static int cpu_gfni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 8 & 1);
}

/* Pins a 512-bit v to a register here (see KEEP; "v": any of the 32). */
#define KEEP512(v) __asm__("" : "+v"(v))

/* One 4-row block against x's one row, as bytes: into acc (column 0), each group's scale
   applied (zero points not yet). `lanes`: where gs < S, the group of each lane of a step.
   Two sums per weight row (hi and lo products): 8 chains, each named and pinned (GCC kept
   arrays of them on the stack, copied every step). `ahead`: bytes from a row to the same
   row of the block to prefetch (0: none); a step reads one line of each row, and prefetches
   that line of the block ahead into L2, as gemv_avx512.c does. */
static inline __attribute__((always_inline)) void block_bytes(
    int kind, int gfni, const uint8_t* xb, const int32_t* xcorr, const uint8_t* const* wr,
    const float* const* sr, int64_t K, Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    const int S = bytes_step(kind), B = S * (kind == Q_U8 ? 8 : 4) / 8; /* code bytes a step */
    const __m512i flip = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(15);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    const float *s0 = sr[0], *s1 = sr[1], *s2 = sr[2], *s3 = sr[3];
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    const uint8_t* xs = xb;
    int64_t b = 0; /* code bytes into a row */
    for (int64_t c0 = 0, c = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len, c++) {
        __m512i l0 = kind == Q_U8 ? _mm512_loadu_si512(xcorr + 16 * c) : _mm512_setzero_si512();
        __m512i l1 = l0, l2 = l0, l3 = l0;
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0;
        for (int64_t k = 0; k < ch.len; k += S, b += B, xs += 2 * S) {
            if (ahead) {
                _mm_prefetch((const char*)w0 + ahead + b, _MM_HINT_T1);
                _mm_prefetch((const char*)w1 + ahead + b, _MM_HINT_T1);
                _mm_prefetch((const char*)w2 + ahead + b, _MM_HINT_T1);
                _mm_prefetch((const char*)w3 + ahead + b, _MM_HINT_T1);
            }
            if (kind == Q_U8) {
                __m512i xh = _mm512_loadu_si512(xs), xl = _mm512_loadu_si512(xs + 64);
#define BYTES_U8(h, l, p)                                                                  \
    {                                                                                      \
        __m512i w = _mm512_loadu_si512(p + b);                                             \
        h = _mm512_dpbusd_epi32(h, w, xh);                                                 \
        KEEP512(h);                                                                        \
        l = _mm512_dpbusd_epi32(l, xl, _mm512_xor_si512(w, flip));                         \
        KEEP512(l);                                                                        \
    }
                BYTES_U8(h0, l0, w0)
                BYTES_U8(h1, l1, w1)
                BYTES_U8(h2, l2, w2)
                BYTES_U8(h3, l3, w3)
#undef BYTES_U8
            } else {
                __m512i he = _mm512_loadu_si512(xs), ho = _mm512_loadu_si512(xs + 64);
                __m512i le = _mm512_loadu_si512(xs + 128), lo = _mm512_loadu_si512(xs + 192);
#define BYTES_U4(h, l, p)                                                                  \
    {                                                                                      \
        __m512i w = _mm512_loadu_si512(p + b);                                             \
        __m512i e = _mm512_and_si512(w, m4);                                               \
        __m512i o = high_nibbles(w, gfni);                                                 \
        h = _mm512_dpbusd_epi32(h, e, he);                                                 \
        l = _mm512_dpbusd_epi32(l, le, e);                                                 \
        h = _mm512_dpbusd_epi32(h, o, ho);                                                 \
        KEEP512(h);                                                                        \
        l = _mm512_dpbusd_epi32(l, lo, o);                                                 \
        KEEP512(l);                                                                        \
    }
                BYTES_U4(h0, l0, w0)
                BYTES_U4(h1, l1, w1)
                BYTES_U4(h2, l2, w2)
                BYTES_U4(h3, l3, w3)
#undef BYTES_U4
            }
        }
        /* 256 * hi + lo, exact in int32 (see the top), then fp32 times the scale(s) */
#define BYTES_FOLD(f, h, l, sp)                                                            \
    {                                                                                      \
        __m512i t = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);                          \
        __m512 s = ch.gstep ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sp + g)) \
                            : _mm512_set1_ps(sp[g]);                                       \
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, f);                                  \
    }
        BYTES_FOLD(f0, h0, l0, s0)
        BYTES_FOLD(f1, h1, l1, s1)
        BYTES_FOLD(f2, h2, l2, s2)
        BYTES_FOLD(f3, h3, l3, s3)
#undef BYTES_FOLD
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    acc->v[0][0] = fold512ps(f0), acc->v[1][0] = fold512ps(f1);
    acc->v[2][0] = fold512ps(f2), acc->v[3][0] = fold512ps(f3);
}

/* block_bytes for 4-bit codes in groups of 128 (a chunk a step), software-pipelined: a step's
   dot products are issued before the previous step's fold, whose sums are ready by then, so
   the fold's chain (shift, add, convert, FMA: ~12 cycles after the last VPDPBUSD) does not
   hold the scheduler's entries while the next step waits behind it. The same sums and fold,
   so the same bits. Two rows at a time instead of four: 0.8-0.9x the speed (fewer x loads
   shared); four rows spill one of their 30 zmm, which costs less. */
static inline __attribute__((always_inline)) void block_bytes_u4_g128(
    int gfni, const uint8_t* xb, const uint8_t* const* wr, const float* const* sr, int64_t K,
    int64_t ahead, Acc* acc) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    const float *s0 = sr[0], *s1 = sr[1], *s2 = sr[2], *s3 = sr[3];
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    __m512i h0, h1, h2, h3, l0, l1, l2, l3;
#define STEP_U4(h, l, p, b)                                                                \
    {                                                                                      \
        __m512i w = _mm512_loadu_si512(p + b);                                             \
        __m512i e = _mm512_and_si512(w, m4), o = high_nibbles(w, gfni);                    \
        h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), e, he);                            \
        l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), le, e);                            \
        h = _mm512_dpbusd_epi32(h, o, ho);                                                 \
        l = _mm512_dpbusd_epi32(l, lo, o);                                                 \
    }
#define STEPS_U4(b, xs)                                                                    \
    {                                                                                      \
        _mm_prefetch((const char*)w0 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w1 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w2 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w3 + ahead + b, _MM_HINT_T1);                            \
        __m512i he = _mm512_loadu_si512(xs), ho = _mm512_loadu_si512(xs + 64);             \
        __m512i le = _mm512_loadu_si512(xs + 128), lo = _mm512_loadu_si512(xs + 192);      \
        STEP_U4(h0, l0, w0, b)                                                             \
        STEP_U4(h1, l1, w1, b)                                                             \
        STEP_U4(h2, l2, w2, b)                                                             \
        STEP_U4(h3, l3, w3, b)                                                             \
    }
#define FOLD_U4(f, h, l, sp, g)                                                            \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l)),   \
                        _mm512_set1_ps(sp[g]), f);
    STEPS_U4(0, xb)
    int64_t g = 0;
    for (int64_t b = 64; b < K / 2; b += 64, g++) {
        __m512i p0 = h0, p1 = h1, p2 = h2, p3 = h3, q0 = l0, q1 = l1, q2 = l2, q3 = l3;
        STEPS_U4(b, xb + 4 * b)
        FOLD_U4(f0, p0, q0, s0, g)
        FOLD_U4(f1, p1, q1, s1, g)
        FOLD_U4(f2, p2, q2, s2, g)
        FOLD_U4(f3, p3, q3, s3, g)
    }
    FOLD_U4(f0, h0, l0, s0, g)
    FOLD_U4(f1, h1, l1, s1, g)
    FOLD_U4(f2, h2, l2, s2, g)
    FOLD_U4(f3, h3, l3, s3, g)
#undef FOLD_U4
#undef STEPS_U4
#undef STEP_U4
    acc->v[0][0] = fold512ps(f0), acc->v[1][0] = fold512ps(f1);
    acc->v[2][0] = fold512ps(f2), acc->v[3][0] = fold512ps(f3);
}

/* One weight row's chunk of 8-bit codes against x's high and low bytes (block_bytes'
   layout, len a multiple of 64) as one run: the integer sum 256 * sum(w * hi) + sum(w * lo)
   per lane, starting from l (x's correction). Two sets of sums (even and odd steps, exact
   integer adds) halve the VPDPBUSD chains. */
static inline __attribute__((always_inline)) __m512i u8_run_sums(const uint8_t* w,
                                                                 const uint8_t* xs, __m512i l,
                                                                 int64_t len, int64_t ahead) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const char* pf = ahead ? (const char*)w + ahead : NULL;
    __m512i h = _mm512_setzero_si512(), h2 = h, l2 = h;
    int64_t k = 0;
    for (; k + 128 <= len; k += 128, xs += 256) {
        if (pf) {
            _mm_prefetch(pf + k, _MM_HINT_T1);
            _mm_prefetch(pf + k + 64, _MM_HINT_T1);
        }
        __m512i wa = _mm512_loadu_si512(w + k), wb = _mm512_loadu_si512(w + k + 64);
        h = _mm512_dpbusd_epi32(h, wa, _mm512_loadu_si512(xs));
        l = _mm512_dpbusd_epi32(l, _mm512_loadu_si512(xs + 64), _mm512_xor_si512(wa, flip));
        h2 = _mm512_dpbusd_epi32(h2, wb, _mm512_loadu_si512(xs + 128));
        l2 = _mm512_dpbusd_epi32(l2, _mm512_loadu_si512(xs + 192), _mm512_xor_si512(wb, flip));
    }
    if (k < len) { /* a last step (chunks are whole steps of 64) */
        if (pf) _mm_prefetch(pf + k, _MM_HINT_T1);
        __m512i wa = _mm512_loadu_si512(w + k);
        h = _mm512_dpbusd_epi32(h, wa, _mm512_loadu_si512(xs));
        l = _mm512_dpbusd_epi32(l, _mm512_loadu_si512(xs + 64), _mm512_xor_si512(wa, flip));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h, h2), 8),
                            _mm512_add_epi32(l, l2));
}

/* A weight row's scales for chunk g: per group spread over the lanes, or its one scale. */
static inline __attribute__((always_inline)) __m512 chunk_scales(const float* sp, int64_t g,
                                                                 Chunks ch, __mmask16 smask,
                                                                 __m512i lanes) {
    return ch.gstep ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sp + g))
                    : _mm512_set1_ps(sp[g]);
}

/* block_bytes_u8_runs and x8v_one_u8: the 4 rows' runs per chunk, folded to fp32 with each
   row's scales per chunk, times x's per-chunk scales where xsl is given (x in 8 bits). */
static inline __attribute__((always_inline)) void u8_runs(const uint8_t* xb,
                                                          const int32_t* xcorr, const float* xsl,
                                                          const uint8_t* const* wr,
                                                          const float* const* sr, int64_t K,
                                                          Chunks ch, int64_t ahead,
                                                          __m512i lanes, Acc* acc) {
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    __m512 f[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t c0 = 0, c = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len, c++) {
        const uint8_t* xs0 = xb + 2 * c0;
        const __m512i corr = _mm512_loadu_si512(xcorr + 16 * c);
        for (int j = 0; j < 4; j++) {
            __m512i t = u8_run_sums(wr[j] + c0, xs0, corr, ch.len, ahead);
            __m512 sc = chunk_scales(sr[j], g, ch, smask, lanes);
            if (xsl) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(xsl + 16 * c));
            f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, f[j]);
        }
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    for (int j = 0; j < 4; j++) acc->v[j][0] = fold512ps(f[j]);
}

/* block_bytes for 8-bit codes a chunk of one weight row at a time: each row's chunk (up to
   FLUSH codes, 16 lines) is read as one run, the 4 rows' runs one after another, where
   block_bytes reads a line of each row in turn (4 streams the hardware prefetcher follows
   less well: one row of x, 1 thread, cold weights, Qwen3-0.6B shapes, AMD EPYC Zen 4, 1.1-1.2x
   the rate). The chunk of x (2 KB) stays in L1 across the 4 rows. The same per-lane integer
   sums and the same fold per chunk, so the same bits (u8_runs). */
static void block_bytes_u8_runs(const uint8_t* xb, const int32_t* xcorr,
                                const uint8_t* const* wr, const float* const* sr, int64_t K,
                                Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    u8_runs(xb, xcorr, NULL, wr, sr, K, ch, ahead, lanes, acc);
}
/* 1: one row of x against 8-bit codes reads a block's rows a chunk at a time
   (block_bytes_u8_runs); 0: a line of each in turn (block_bytes). The same bits; a switch
   for the tests and benchmarks. */
int qgemv_rows_seq = 1;

/* 8-bit codes against several rows of x as bytes (M <= BYTES_ROWS_MAX): per chunk, each pair
   of rows of x in turn against the block's 4 weight rows, a step at a time (4 x loads, then
   per weight row a load, an XOR and four VPDPBUSD: 8 loads per 16 multiply ops). Each
   (64 codes, x row) costs two VPDPBUSD (x's high and low bytes), as many as VDPBF16PS
   takes for bf16 weights, so 8 rows cost what 8 rows of the bf16 panel do, not less (on
   Zen 4 8 rows stay ~2x one row's time at best). Hot at 16 rows this loop issues its
   VPDPBUSD at ~0.7x the rate the bf16 panel issues VDPBF16PS (2.1 against 3.0 G a second,
   one thread), where a register-only loop of either issues alike: the gap is this loop's
   loads (8 zmm loads per 16 ops, the panel's ~1 plus dword broadcasts). Codes laid out as
   the panel's ([K/4][16 rows][4 bytes], x's bytes broadcast per row) would close it: not
   done. The block's chunk of codes (4 KB) is
   read from memory on the first row and from L1 after. The same per-lane sums and fold as
   block_bytes for every row, so a row's result does not depend on the rows beside it.
   acc: a slot per pair of rows, as block_int_many's. */
static void block_bytes_u8_many(const uint8_t* xb, const int32_t* xcorr,
                                const uint8_t* const* wr, const float* const* sr, int64_t M,
                                int64_t K, Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    __m512 f[BYTES_ROWS_MAX][4];
    for (int64_t i = 0; i < M; i++)
        for (int j = 0; j < 4; j++) f[i][j] = _mm512_setzero_ps();
    const int64_t cw = K / 64 * 16; /* xcorr's ints per row of x */
    for (int64_t c0 = 0, c = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len, c++) {
        __m512 sc[4];
        for (int j = 0; j < 4; j++)
            sc[j] = ch.gstep
                        ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sr[j] + g))
                        : _mm512_set1_ps(sr[j][g]);
        for (int64_t i = 0; i < M; i += 2) {
            /* rows i and i + 1 (i alone at an odd end: its sums twice, the second dropped) */
            const int64_t i1 = i + 1 < M ? i + 1 : i;
            const uint8_t* xa = xb + i * 2 * K + 2 * c0;
            const uint8_t* xc = xb + i1 * 2 * K + 2 * c0;
            __m512i la0 = _mm512_loadu_si512(xcorr + i * cw + 16 * c);
            __m512i lc0 = _mm512_loadu_si512(xcorr + i1 * cw + 16 * c);
            __m512i la1 = la0, la2 = la0, la3 = la0, lc1 = lc0, lc2 = lc0, lc3 = lc0;
            __m512i ha0 = _mm512_setzero_si512(), ha1 = ha0, ha2 = ha0, ha3 = ha0;
            __m512i hc0 = ha0, hc1 = ha0, hc2 = ha0, hc3 = ha0;
            for (int64_t k = c0; k < c0 + ch.len; k += 64, xa += 128, xc += 128) {
                if (i == 0 && ahead) {
                    _mm_prefetch((const char*)w0 + ahead + k, _MM_HINT_T1);
                    _mm_prefetch((const char*)w1 + ahead + k, _MM_HINT_T1);
                    _mm_prefetch((const char*)w2 + ahead + k, _MM_HINT_T1);
                    _mm_prefetch((const char*)w3 + ahead + k, _MM_HINT_T1);
                }
                __m512i ah = _mm512_loadu_si512(xa), al = _mm512_loadu_si512(xa + 64);
                __m512i ch_ = _mm512_loadu_si512(xc), cl = _mm512_loadu_si512(xc + 64);
#define MANY_U8(n, p)                                                                      \
    {                                                                                      \
        __m512i w = _mm512_loadu_si512(p + k), wf = _mm512_xor_si512(w, flip);             \
        ha##n = _mm512_dpbusd_epi32(ha##n, w, ah);                                         \
        hc##n = _mm512_dpbusd_epi32(hc##n, w, ch_);                                        \
        la##n = _mm512_dpbusd_epi32(la##n, al, wf);                                        \
        lc##n = _mm512_dpbusd_epi32(lc##n, cl, wf);                                        \
    }
                MANY_U8(0, w0)
                MANY_U8(1, w1)
                MANY_U8(2, w2)
                MANY_U8(3, w3)
#undef MANY_U8
            }
            __m512i hs[2][4] = {{ha0, ha1, ha2, ha3}, {hc0, hc1, hc2, hc3}};
            __m512i ls[2][4] = {{la0, la1, la2, la3}, {lc0, lc1, lc2, lc3}};
            for (int r = 0; r < (i1 > i ? 2 : 1); r++)
                for (int jj = 0; jj < 4; jj++) {
                    __m512i t = _mm512_add_epi32(_mm512_slli_epi32(hs[r][jj], 8), ls[r][jj]);
                    f[i + r][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc[jj], f[i + r][jj]);
                }
        }
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    for (int64_t i = 0; i < M; i++)
        for (int j = 0; j < 4; j++) acc[i / 2].v[j][i & 1] = fold512ps(f[i][j]);
}

/* The same for 4-bit codes (block_bytes' layout of x: per step of 128 features the high bytes
   of the even and odd features, then the low ones, 64 each): per pair of x rows and weight
   row, a step's nibbles split once and four VPDPBUSD per x row, two per 64 codes as for 8-bit
   codes (the int16 scratch path takes four). */
static inline __attribute__((always_inline)) void block_bytes_u4_many(
    int gfni, const uint8_t* xb, const uint8_t* const* wr, const float* const* sr, int64_t M,
    int64_t K, Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    __m512 f[BYTES_ROWS_MAX][4];
    for (int64_t i = 0; i < M; i++)
        for (int j = 0; j < 4; j++) f[i][j] = _mm512_setzero_ps();
    for (int64_t c0 = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len) {
        __m512 sc[4];
        for (int j = 0; j < 4; j++)
            sc[j] = ch.gstep
                        ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sr[j] + g))
                        : _mm512_set1_ps(sr[j][g]);
        for (int64_t i = 0; i < M; i += 2) {
            const int64_t i1 = i + 1 < M ? i + 1 : i;
            const uint8_t* xa = xb + i * 2 * K + 2 * c0;
            const uint8_t* xc = xb + i1 * 2 * K + 2 * c0;
            __m512i ha0 = _mm512_setzero_si512(), ha1 = ha0, ha2 = ha0, ha3 = ha0;
            __m512i hc0 = ha0, hc1 = ha0, hc2 = ha0, hc3 = ha0;
            __m512i la0 = ha0, la1 = ha0, la2 = ha0, la3 = ha0;
            __m512i lc0 = ha0, lc1 = ha0, lc2 = ha0, lc3 = ha0;
            for (int64_t k = c0; k < c0 + ch.len; k += 128, xa += 256, xc += 256) {
                const int64_t b = k / 2;
                if (i == 0 && ahead) {
                    _mm_prefetch((const char*)w0 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w1 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w2 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w3 + ahead + b, _MM_HINT_T1);
                }
                __m512i ahe = _mm512_loadu_si512(xa), aho = _mm512_loadu_si512(xa + 64);
                __m512i ale = _mm512_loadu_si512(xa + 128), alo = _mm512_loadu_si512(xa + 192);
                __m512i che = _mm512_loadu_si512(xc), cho = _mm512_loadu_si512(xc + 64);
                __m512i cle = _mm512_loadu_si512(xc + 128), clo = _mm512_loadu_si512(xc + 192);
#define MANY_U4(n, p)                                                                      \
    {                                                                                      \
        __m512i v = _mm512_loadu_si512(p + b);                                             \
        __m512i e = _mm512_and_si512(v, m4), o = high_nibbles(v, gfni);                    \
        ha##n = _mm512_dpbusd_epi32(ha##n, e, ahe);                                        \
        hc##n = _mm512_dpbusd_epi32(hc##n, e, che);                                        \
        la##n = _mm512_dpbusd_epi32(la##n, ale, e);                                        \
        lc##n = _mm512_dpbusd_epi32(lc##n, cle, e);                                        \
        ha##n = _mm512_dpbusd_epi32(ha##n, o, aho);                                        \
        hc##n = _mm512_dpbusd_epi32(hc##n, o, cho);                                        \
        la##n = _mm512_dpbusd_epi32(la##n, alo, o);                                        \
        lc##n = _mm512_dpbusd_epi32(lc##n, clo, o);                                        \
    }
                MANY_U4(0, w0)
                MANY_U4(1, w1)
                MANY_U4(2, w2)
                MANY_U4(3, w3)
#undef MANY_U4
            }
            __m512i hs[2][4] = {{ha0, ha1, ha2, ha3}, {hc0, hc1, hc2, hc3}};
            __m512i ls[2][4] = {{la0, la1, la2, la3}, {lc0, lc1, lc2, lc3}};
            for (int r = 0; r < (i1 > i ? 2 : 1); r++)
                for (int jj = 0; jj < 4; jj++) {
                    __m512i t = _mm512_add_epi32(_mm512_slli_epi32(hs[r][jj], 8), ls[r][jj]);
                    f[i + r][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc[jj], f[i + r][jj]);
                }
        }
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    for (int64_t i = 0; i < M; i++)
        for (int j = 0; j < 4; j++) acc[i / 2].v[j][i & 1] = fold512ps(f[i][j]);
}

static void run_bytes_many(int kind, int gfni, const uint8_t* xb, const int32_t* xcorr,
                           const uint8_t* const* wr, const float* const* sr, int64_t M,
                           int64_t K, Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    if (kind == Q_U8) block_bytes_u8_many(xb, xcorr, wr, sr, M, K, ch, ahead, lanes, acc);
    else if (gfni) block_bytes_u4_many(1, xb, wr, sr, M, K, ch, ahead, lanes, acc);
    else block_bytes_u4_many(0, xb, wr, sr, M, K, ch, ahead, lanes, acc);
}

/* The group of each lane of a step, for groups shorter than it (see the top). */
static inline __m512i bytes_lanes(int kind, int64_t gs) {
    int32_t idx[16];
    for (int l = 0; l < 16; l++) idx[l] = (int32_t)(l * (bytes_step(kind) / 16) / gs);
    return _mm512_loadu_si512(idx);
}

/* block_bytes compiled for each kind, with and without GFNI (see run_block). */
static void run_bytes(int kind, int gfni, const uint8_t* xb, const int32_t* xcorr,
                      const uint8_t* const* wr, const float* const* sr, int64_t K, Chunks ch,
                      int64_t ahead, __m512i lanes, Acc* acc) {
    if (kind == Q_U8) block_bytes(Q_U8, 0, xb, xcorr, wr, sr, K, ch, ahead, lanes, acc);
    else if (gfni) block_bytes(Q_U4, 1, xb, xcorr, wr, sr, K, ch, ahead, lanes, acc);
    else block_bytes(Q_U4, 0, xb, xcorr, wr, sr, K, ch, ahead, lanes, acc);
}

/* x in 8 bits against 8- and 4-bit codes with AVX512-VNNI (--cpu-quantized-activations int8,
   qgemv_x8): one VPDPBUSD per 64 codes and row of x (the unsigned code byte times x's signed
   byte), where the exact path takes two (x's high and low bytes) and, for 8-bit codes, an
   XOR. The chunks are block_bytes' (a group of at most FLUSH features, a longer group's
   equal parts, or a step of several short groups), and x's scale is per chunk and lane:
   lane l of a step's sums holds the same S / 16 features of every step (8-bit: features
   4l..4l+3 of 64; 4-bit: 8l..8l+7 of 128), so x is rounded to 8 bits per block of those
   features over a chunk (len / 16 features: at most 64, 8 in groups of 128; max|x| / 127,
   round to nearest even), and a chunk's exact integer sums become fp32 once, times the
   group's scale times x's 16 per-lane scales, in one FMA per weight row (no flush per block
   of x). x's layout: for 8-bit codes x as it is, for 4-bit per step of 128 features its 64
   evens, then its 64 odds. The zero points take the groups' sums of x in the same scaled
   units (xsum) and the row's xscale is 1. Rows of x are taken four, then two, then one at a
   time against a block's 4 weight rows (the chunk's codes from L1 after the first), each
   row's sums and fold the same whatever rows are beside it: a row's result does not depend
   on the batch. Measured (AMD EPYC Zen 4, 1 thread, CPU time, cold weights, shared machine,
   interleaved): 8-bit per channel at 8 rows 0.69-0.72x the exact byte path's time, 4-bit
   group 128 at 8-16 rows 0.81-0.85x; one row 8-bit 1.03-1.13x in x8v_one's loop (one row of
   8-bit codes now takes the exact path's loop: x8v_one_u8), 4-bit 0.93-1.01x; a
   Qwen3-0.6B-shaped decode step of 8 rows, int8: 0.73x. */
#define X8V_ROWS 64

static inline int x8v_takes(int kind, int64_t K, int64_t gs) {
    int S = bytes_step(kind == Q_U8 ? Q_U8 : Q_U4);
    return kind != Q_FP8 && K % S == 0 && (gs % S == 0 || S % gs == 0);
}

/* One row of x against 8-bit codes runs block_bytes_u8_runs' loop (x8v_one_u8), so its 8-bit
   codes are also written as that loop's bytes (see the byte path at QBYTES): after xq's K
   codes, per step of 64 features the high bytes (0 or -1: the sign), then the low bytes; then
   128 * the sum of the low bytes per chunk and lane (xcorr, [K / len][16]). The bytes xq takes
   for M rows of x. */
static inline int x8v_as_bytes(int kind, int64_t M) { return kind == Q_U8 && M == 1; }
static inline int64_t x8v_xq_bytes(int kind, int64_t M, int64_t K) {
    return ((x8v_as_bytes(kind, M) ? 4 * K : M * K) + 63) / 64 * 64;
}

static void x8v_bytes_row(const int8_t* q, int64_t K, Chunks ch, uint8_t* xb) {
    for (int64_t k = 0; k < K; k += 64) {
        __m512i v = _mm512_loadu_si512(q + k);
        __mmask64 neg = _mm512_movepi8_mask(v);
        _mm512_storeu_si512(xb + 2 * k, _mm512_movm_epi8(neg)); /* 0xFF where negative */
        _mm512_storeu_si512(xb + 2 * k + 64, v);
    }
    bytes_xcorr(xb, K, ch.len, (int32_t*)(xb + 2 * K));
}

/* x row m of M -> int8 codes in x8v's layout (xq row m: K bytes; where x8v_as_bytes, also as
   bytes after them), x's scales per chunk and lane (xsl row m: [K / len][16]), the groups' sums
   of x in scaled units (xsum), xscale[m] = 1. */
static void quantize_x8v(int kind, const void* x, int x_bf16, int64_t m, int64_t M, int64_t K,
                         int64_t gs, Chunks ch, __m512i lanes, int8_t* xq, float* xsl,
                         float* xscale, float* xsum) {
    const int S = bytes_step(kind), F = S / 16, V = S / 16; /* features a lane and step */
    const int64_t C = K / ch.len, G = K / gs;
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    int8_t* q = xq + m * K;
    int32_t gl[16];
    _mm512_storeu_si512(gl, lanes);
    xscale[m] = 1.0f;
    for (int64_t g = 0; g < G; g++) xsum[m * G + g] = 0.0f;
    for (int64_t c = 0, c0 = 0; c < C; c++, c0 += ch.len) {
        __m512 mx[8];
        for (int i = 0; i < V; i++) mx[i] = _mm512_setzero_ps();
        for (int64_t k = c0; k < c0 + ch.len; k += S)
            for (int i = 0; i < V; i++)
                mx[i] = _mm512_max_ps(
                    mx[i], _mm512_and_ps(load16_x(x, x_bf16, m * K + k + 16 * i), abs_mask));
        float mf[128], inv[128];
        float* s = xsl + (m * C + c) * 16;
        for (int i = 0; i < V; i++) _mm512_storeu_ps(mf + 16 * i, mx[i]);
        for (int l = 0; l < 16; l++) {
            float amax = 0;
            for (int f = l * F; f < (l + 1) * F; f++) amax = mf[f] > amax ? mf[f] : amax;
            s[l] = amax > 0 && isfinite(amax) ? amax / 127.0f : 1.0f;
            float r = 1.0f / s[l];
            for (int f = l * F; f < (l + 1) * F; f++) inv[f] = r;
        }
        __m512i cs = _mm512_setzero_si512(); /* per lane: the sum of its codes */
        for (int64_t k = c0; k < c0 + ch.len; k += S) {
            for (int i = 0; i < V; i++) {
                __m512 v = _mm512_mul_ps(load16_x(x, x_bf16, m * K + k + 16 * i),
                                         _mm512_loadu_ps(inv + 16 * i));
                __m512i c8 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(v), top), bottom);
                if (kind == Q_U8) {
                    _mm_storeu_si128((__m128i*)(q + k + 16 * i), _mm512_cvtepi32_epi8(c8));
                } else { /* the even features are the low dwords of c8's qwords */
                    _mm_storel_epi64((__m128i*)(q + k + 8 * i), _mm512_cvtepi64_epi8(c8));
                    _mm_storel_epi64((__m128i*)(q + k + 64 + 8 * i),
                                     _mm512_cvtepi64_epi8(_mm512_srli_epi64(c8, 32)));
                }
            }
            for (int p = 0; p < S; p += 64)
                cs = _mm512_dpbusd_epi32(cs, _mm512_set1_epi8(1), _mm512_loadu_si512(q + k + p));
        }
        int32_t csl[16];
        _mm512_storeu_si512(csl, cs);
        for (int l = 0; l < 16; l++) {
            int64_t g = ch.gstep ? c * ch.gstep + gl[l] : c / ch.per;
            xsum[m * G + g] += s[l] * (float)csl[l];
        }
    }
    if (x8v_as_bytes(kind, M)) x8v_bytes_row(q, K, ch, (uint8_t*)xq + K);
}

/* One chunk of R rows of x (x0[r]: row r's codes at the chunk) against a block's 4 weight
   rows (wc[j]: row j's codes at the chunk), folded into f (f[r * 4 + j]) with the chunk's
   weight scales sc[j] and x's per-lane scales (xs[r]). `ahead`: as block_bytes. `near`
   (0: none): bytes from the chunk to the codes of the chunk taken next (x8v_near), whose
   lines are prefetched into L1 as this chunk's are read. */
static inline __attribute__((always_inline)) void x8v_rows(
    int kind, int gfni, int R, const int8_t* const* x0, const float* const* xs,
    const uint8_t* const* wc, int64_t len, int64_t ahead, int64_t near, const __m512* sc,
    __m512* f) {
    const int S = bytes_step(kind);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i a[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < len; k += S) {
        const int64_t b = kind == Q_U8 ? k : k / 2; /* code bytes into the chunk */
        if (ahead)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char*)wc[j] + ahead + b, _MM_HINT_T1);
        if (near)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char*)wc[j] + near + b, _MM_HINT_T0);
        if (kind == Q_U8) {
            __m512i xv[4];
            for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_si512(x0[r] + k);
            for (int j = 0; j < 4; j++) {
                __m512i w = _mm512_loadu_si512(wc[j] + b);
                for (int r = 0; r < R; r++) {
                    a[r][j] = _mm512_dpbusd_epi32(a[r][j], w, xv[r]);
                    KEEP512(a[r][j]);
                }
            }
        } else {
            __m512i xe[4], xo[4];
            for (int r = 0; r < R; r++) {
                xe[r] = _mm512_loadu_si512(x0[r] + k);
                xo[r] = _mm512_loadu_si512(x0[r] + k + 64);
            }
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(wc[j] + b);
                __m512i e = _mm512_and_si512(v, m4), o = high_nibbles(v, gfni);
                for (int r = 0; r < R; r++) {
                    a[r][j] = _mm512_dpbusd_epi32(a[r][j], e, xe[r]);
                    a[r][j] = _mm512_dpbusd_epi32(a[r][j], o, xo[r]);
                    KEEP512(a[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 xv = _mm512_loadu_ps(xs[r]);
        for (int j = 0; j < 4; j++)
            f[r * 4 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][j]), _mm512_mul_ps(sc[j], xv),
                                           f[r * 4 + j]);
    }
}

/* x8v_rows for one row of x against 8-bit codes, a weight row's chunk at a time as one run
   (as block_bytes_u8_runs: one stream; 1 thread, cold, Qwen3-0.6B shapes, AMD EPYC Zen 4:
   1.3-1.4x the rate of a line of each row in turn), two sums per row (even and odd steps,
   exact integer adds): the same sums and fold, so the same bits. */
static inline __attribute__((always_inline)) void x8v_runs_u8(
    const int8_t* x0, const float* xs, const uint8_t* const* wc, int64_t len, int64_t ahead,
    int64_t near, const __m512* sc, __m512* f) {
    const __m512 xv = _mm512_loadu_ps(xs);
    for (int j = 0; j < 4; j++) {
        const uint8_t* w = wc[j];
        __m512i a = _mm512_setzero_si512(), b = a;
        int64_t k = 0;
        for (; k + 128 <= len; k += 128) {
            if (ahead) {
                _mm_prefetch((const char*)w + ahead + k, _MM_HINT_T1);
                _mm_prefetch((const char*)w + ahead + k + 64, _MM_HINT_T1);
            }
            if (near) {
                _mm_prefetch((const char*)w + near + k, _MM_HINT_T0);
                _mm_prefetch((const char*)w + near + k + 64, _MM_HINT_T0);
            }
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(w + k), _mm512_loadu_si512(x0 + k));
            b = _mm512_dpbusd_epi32(b, _mm512_loadu_si512(w + k + 64),
                                    _mm512_loadu_si512(x0 + k + 64));
        }
        if (k < len) {
            if (ahead) _mm_prefetch((const char*)w + ahead + k, _MM_HINT_T1);
            if (near) _mm_prefetch((const char*)w + near + k, _MM_HINT_T0);
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(w + k), _mm512_loadu_si512(x0 + k));
        }
        f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)),
                               _mm512_mul_ps(sc[j], xv), f[j]);
    }
}

/* One row of x in 8 bits against a block of 8-bit codes: block_bytes_u8_runs' loop on x's
   bytes (x8v_bytes_row: 256 * sum(w * hi) + sum(w * lo) = sum(w * x), the integer sums x8v_one
   takes) and x8v_one's fold, so the same bits as x8v's other paths. x8v_one's loop, one
   VPDPBUSD per 64 codes, streamed at 0.83-0.87x the rate of this one (two, and an XOR) in the
   fast phases of this machine's memory (Qwen3-0.6B's LM head, 1 thread, cold, CPU time, AMD
   EPYC Zen 4), at 1.0x in its slow phases; the same op count in x8v_one's order did not close
   it, nor did the prefetch's distance or hint: why is not known. */
static void x8v_one_u8(const uint8_t* xb, const float* xsl, const uint8_t* const* wr,
                       const float* const* sr, int64_t K, Chunks ch, int64_t ahead,
                       __m512i lanes, Acc* acc) {
    u8_runs(xb, (const int32_t*)(xb + 2 * K), xsl, wr, sr, K, ch, ahead, lanes, acc);
}

/* One row of x against a 4-row block over all chunks, the fold's sums in registers (x8v_rows
   keeps them in memory between chunks: a load and a store per weight row and chunk, as many
   ops as the products themselves where a chunk is one step, 4-bit groups of 128); the same
   integer sums and the same fold in the same order, so the same bits. 8-bit codes a weight
   row's chunk at a time as one run (as x8v_runs_u8). */
static inline __attribute__((always_inline)) void x8v_one(
    int kind, int gfni, const int8_t* x, const float* xsl, const uint8_t* const* wr,
    const float* const* sr, int64_t K, Chunks ch, int64_t ahead, __m512i lanes, Acc* acc) {
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    const int S = bytes_step(kind);
    const __m512i m4 = _mm512_set1_epi8(15);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int64_t c0 = 0, c = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len, c++) {
        const __m512 xv = _mm512_loadu_ps(xsl + 16 * c);
        const int8_t* xc = x + c0;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        if (kind == Q_U8) {
#define X8V_RUN(a, p)                                                                      \
    {                                                                                      \
        const uint8_t* w = p + c0;                                                         \
        __m512i b = _mm512_setzero_si512();                                                \
        int64_t k = 0;                                                                     \
        for (; k + 128 <= ch.len; k += 128) {                                              \
            if (ahead) {                                                                   \
                _mm_prefetch((const char*)w + ahead + k, _MM_HINT_T1);                     \
                _mm_prefetch((const char*)w + ahead + k + 64, _MM_HINT_T1);                \
            }                                                                              \
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(w + k), _mm512_loadu_si512(xc + k)); \
            b = _mm512_dpbusd_epi32(b, _mm512_loadu_si512(w + k + 64),                     \
                                    _mm512_loadu_si512(xc + k + 64));                      \
        }                                                                                  \
        if (k < ch.len) {                                                                  \
            if (ahead) _mm_prefetch((const char*)w + ahead + k, _MM_HINT_T1);              \
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(w + k), _mm512_loadu_si512(xc + k)); \
        }                                                                                  \
        a = _mm512_add_epi32(a, b);                                                        \
    }
            X8V_RUN(a0, w0)
            X8V_RUN(a1, w1)
            X8V_RUN(a2, w2)
            X8V_RUN(a3, w3)
#undef X8V_RUN
        } else {
            for (int64_t k = 0; k < ch.len; k += S) {
                const int64_t b = (c0 + k) / 2;
                if (ahead) {
                    _mm_prefetch((const char*)w0 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w1 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w2 + ahead + b, _MM_HINT_T1);
                    _mm_prefetch((const char*)w3 + ahead + b, _MM_HINT_T1);
                }
                __m512i xe = _mm512_loadu_si512(xc + k), xo = _mm512_loadu_si512(xc + k + 64);
#define X8V_U4(a, p)                                                                       \
    {                                                                                      \
        __m512i v = _mm512_loadu_si512(p + b);                                             \
        __m512i e = _mm512_and_si512(v, m4), o = high_nibbles(v, gfni);                    \
        a = _mm512_dpbusd_epi32(a, e, xe);                                                 \
        a = _mm512_dpbusd_epi32(a, o, xo);                                                 \
        KEEP512(a);                                                                        \
    }
                X8V_U4(a0, w0)
                X8V_U4(a1, w1)
                X8V_U4(a2, w2)
                X8V_U4(a3, w3)
#undef X8V_U4
            }
        }
#define X8V_FOLD(f, a, sp)                                                                 \
    {                                                                                      \
        __m512 s = ch.gstep ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sp + g)) \
                            : _mm512_set1_ps(sp[g]);                                       \
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, xv), f);               \
    }
        X8V_FOLD(f0, a0, sr[0])
        X8V_FOLD(f1, a1, sr[1])
        X8V_FOLD(f2, a2, sr[2])
        X8V_FOLD(f3, a3, sr[3])
#undef X8V_FOLD
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    acc->v[0][0] = fold512ps(f0), acc->v[1][0] = fold512ps(f1);
    acc->v[2][0] = fold512ps(f2), acc->v[3][0] = fold512ps(f3);
}

/* Bytes from a block's chunk at c0 to the chunk taken after it (block_x8v): the block's
   next chunk, or after its last the first of the block `block` bytes on (0: none). More than
   4 rows of x take a chunk in several passes, and only the first reads it from memory (its
   lines prefetched into L2 blocks ahead); the last pass prefetches the next chunk's lines into
   L1, so that the next first pass does not wait on L2 (int8, 8 and 16 rows, 1 thread, cold,
   CPU time, AMD EPYC Zen 4: 1024x3072 0.79x the time, Qwen3-0.6B's other shapes 0.97-1.0x,
   int4 0.98-1.0x; the same bits: prefetches only). */
static inline int64_t x8v_near(int kind, int64_t c0, int64_t len, int64_t K, int64_t block) {
    const int64_t at = kind == Q_U8 ? c0 : c0 / 2, chunk = kind == Q_U8 ? len : len / 2;
    if (c0 + len < K) return chunk;
    return block ? block - at : 0;
}

/* One 4-row block against all M rows of x in 8 bits (see x8v_takes): into acc, a slot per
   pair of rows as block_int_many's; f: [M][4] scratch. */
/* x8v_one for 4-bit codes in groups of 128 (a chunk a step), software-pipelined as
   block_bytes_u4_g128: a step's products issued before the previous step's fold. The same
   sums and fold as x8v_one, so the same bits. */
static inline __attribute__((always_inline)) void x8v_one_u4_g128(
    int gfni, const int8_t* x, const float* xsl, const uint8_t* const* wr,
    const float* const* sr, int64_t K, int64_t ahead, Acc* acc) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const uint8_t *w0 = wr[0], *w1 = wr[1], *w2 = wr[2], *w3 = wr[3];
    const float *s0 = sr[0], *s1 = sr[1], *s2 = sr[2], *s3 = sr[3];
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    __m512i a0, a1, a2, a3;
#define STEP_X8(a, p, b)                                                                   \
    {                                                                                      \
        __m512i v = _mm512_loadu_si512(p + b);                                             \
        __m512i e = _mm512_and_si512(v, m4), o = high_nibbles(v, gfni);                    \
        a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), e, xe);                            \
        a = _mm512_dpbusd_epi32(a, o, xo);                                                 \
    }
#define STEPS_X8(b)                                                                        \
    {                                                                                      \
        _mm_prefetch((const char*)w0 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w1 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w2 + ahead + b, _MM_HINT_T1);                            \
        _mm_prefetch((const char*)w3 + ahead + b, _MM_HINT_T1);                            \
        __m512i xe = _mm512_loadu_si512(x + 2 * b), xo = _mm512_loadu_si512(x + 2 * b + 64); \
        STEP_X8(a0, w0, b)                                                                 \
        STEP_X8(a1, w1, b)                                                                 \
        STEP_X8(a2, w2, b)                                                                 \
        STEP_X8(a3, w3, b)                                                                 \
    }
#define FOLD_X8(f, a, sp, c)                                                               \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),                                             \
                        _mm512_mul_ps(_mm512_set1_ps(sp[c]), _mm512_loadu_ps(xsl + 16 * c)), f);
    STEPS_X8(0)
    int64_t c = 0;
    for (int64_t b = 64; b < K / 2; b += 64, c++) {
        __m512i p0 = a0, p1 = a1, p2 = a2, p3 = a3;
        STEPS_X8(b)
        FOLD_X8(f0, p0, s0, c)
        FOLD_X8(f1, p1, s1, c)
        FOLD_X8(f2, p2, s2, c)
        FOLD_X8(f3, p3, s3, c)
    }
    FOLD_X8(f0, a0, s0, c)
    FOLD_X8(f1, a1, s1, c)
    FOLD_X8(f2, a2, s2, c)
    FOLD_X8(f3, a3, s3, c)
#undef FOLD_X8
#undef STEPS_X8
#undef STEP_X8
    acc->v[0][0] = fold512ps(f0), acc->v[1][0] = fold512ps(f1);
    acc->v[2][0] = fold512ps(f2), acc->v[3][0] = fold512ps(f3);
}

static inline __attribute__((always_inline)) void block_x8v(
    int kind, int gfni, const int8_t* xq, const float* xsl, const uint8_t* const* wr,
    const float* const* sr, int64_t M, int64_t K, Chunks ch, int64_t ahead, __m512i lanes,
    __m512* f, Acc* acc) {
    if (x8v_as_bytes(kind, M) && qgemv_rows_seq) {
        x8v_one_u8((const uint8_t*)xq + K, xsl, wr, sr, K, ch, ahead, lanes, acc);
        return;
    }
    if (M == 1 && qgemv_rows_seq && kind == Q_U4 && ch.len == 128 && !ch.gstep) {
        x8v_one_u4_g128(gfni, xq, xsl, wr, sr, K, ahead, acc);
        return;
    }
    if (M == 1 && qgemv_rows_seq) {
        x8v_one(kind, gfni, xq, xsl, wr, sr, K, ch, ahead, lanes, acc);
        return;
    }
    const __mmask16 smask = (__mmask16)((1 << ch.gstep) - 1);
    const int64_t C = K / ch.len;
    for (int64_t i = 0; i < 4 * M; i++) f[i] = _mm512_setzero_ps();
    for (int64_t c0 = 0, c = 0, g = 0, left = ch.per; c0 < K; c0 += ch.len, c++) {
        __m512 sc[4];
        const uint8_t* wc[4];
        for (int j = 0; j < 4; j++) {
            sc[j] = ch.gstep ? _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(smask, sr[j] + g))
                             : _mm512_set1_ps(sr[j][g]);
            wc[j] = wr[j] + (kind == Q_U8 ? c0 : c0 / 2);
        }
        /* the last of several passes over the chunk prefetches the next one into L1 */
        const int64_t near = x8v_near(kind, c0, ch.len, K, ahead / PF_BLOCKS);
        int64_t i = 0;
        const int8_t* x0[4];
        const float* xs[4];
#define X8V_AT(n)                                                                          \
    for (int r = 0; r < n; r++) {                                                          \
        x0[r] = xq + (i + r) * K + c0;                                                     \
        xs[r] = xsl + ((i + r) * C + c) * 16;                                              \
    }
        for (; i + 4 <= M; i += 4) {
            X8V_AT(4)
            x8v_rows(kind, gfni, 4, x0, xs, wc, ch.len, i ? 0 : ahead,
                     i && i + 4 == M ? near : 0, sc, f + 4 * i);
        }
        if (M - i >= 2) {
            X8V_AT(2)
            x8v_rows(kind, gfni, 2, x0, xs, wc, ch.len, i ? 0 : ahead,
                     i && i + 2 == M ? near : 0, sc, f + 4 * i);
            i += 2;
        }
        if (M - i == 1) {
            X8V_AT(1)
            if (kind == Q_U8 && qgemv_rows_seq)
                x8v_runs_u8(x0[0], xs[0], wc, ch.len, i ? 0 : ahead, i ? near : 0, sc, f + 4 * i);
            else
                x8v_rows(kind, gfni, 1, x0, xs, wc, ch.len, i ? 0 : ahead, i ? near : 0, sc,
                         f + 4 * i);
        }
#undef X8V_AT
        if (ch.gstep) g += ch.gstep;
        else if (--left == 0) g++, left = ch.per;
    }
    for (int64_t i = 0; i < M; i++)
        for (int j = 0; j < 4; j++) acc[i / 2].v[j][i & 1] = fold512ps(f[i * 4 + j]);
}

/* block_x8v compiled for each kind, with and without GFNI. */
static void run_x8v(int kind, int gfni, const int8_t* xq, const float* xsl,
                    const uint8_t* const* wr, const float* const* sr, int64_t M, int64_t K,
                    Chunks ch, int64_t ahead, __m512i lanes, __m512* f, Acc* acc) {
    if (kind == Q_U8) block_x8v(Q_U8, 0, xq, xsl, wr, sr, M, K, ch, ahead, lanes, f, acc);
    else if (gfni) block_x8v(Q_U4, 1, xq, xsl, wr, sr, M, K, ch, ahead, lanes, f, acc);
    else block_x8v(Q_U4, 0, xq, xsl, wr, sr, M, K, ch, ahead, lanes, f, acc);
}
#endif

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
#ifdef __AVX512F__
    case Q_U4 * 2: block_int(Q_U4, xq, wr, sr, m, K, gs, pf, acc); break;
#else
    case Q_U4 * 2: /* block_u4's two ops per row and chunk pay off from 4 steps a chunk */
        if (gs >= 256) block_u4(xq, wr, sr, m, K, gs, pf, acc);
        else block_int(Q_U4, xq, wr, sr, m, K, gs, pf, acc);
        break;
#endif
    case Q_U4W * 2: block_int(Q_U4W, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U8 * 2 + 1: block_int2(Q_U8, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4 * 2 + 1: block_int2(Q_U4, xq, wr, sr, m, K, gs, pf, acc); break;
    case Q_U4W * 2 + 1: block_int2(Q_U4W, xq, wr, sr, m, K, gs, pf, acc); break;
    default:
        if (M - m >= 2) block_fp8(2, xf, wr, sr, m, K, gs, pf, acc);
        else block_fp8(1, xf, wr, sr, m, K, gs, pf, acc);
    }
}

/* y[i .. i + 3] = v as store() writes each: fp32, or bf16 rounded to nearest even (an fp32
   product y * xscale is the correctly rounded double product the scalar path rounds). */
static inline void store4(void* y, int64_t i, __m128 v, int out_bf16) {
    if (!out_bf16) {
        _mm_storeu_ps((float*)y + i, v);
        return;
    }
    __m128i b = _mm_castps_si128(v);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(1));
    b = _mm_srli_epi32(_mm_add_epi32(b, _mm_add_epi32(_mm_set1_epi32(0x7FFF), odd)), 16);
    _mm_storel_epi64((__m128i*)((uint16_t*)y + i), _mm_packus_epi32(b, b));
}

/* How many blocks ahead one row of x prefetches on the byte path (block_bytes,
   block_bytes_u8_runs; one_row_u4 has its own, U4_AHEAD): PF_BLOCKS, or more where that is
   under ONE_ROW_AHEAD bytes. 4-bit codes at K = 1024 (Qwen3-0.6B's q/k/v and gate/up: 2 KB
   blocks) in block_bytes were prefetched 4 KB ahead, too close for the memory's latency
   there: 8 KB ahead took 0.87-0.93x the time (3072x1024,
   4096x1024, 6144x1024; 1 thread, cold weights on huge pages, AMD EPYC Zen 4, interleaved;
   2 threads 0.91-0.96x, best calls on a shared VM); 16 KB no better, and 8-bit codes' 4 KB
   blocks and longer rows (6-12 KB blocks) no faster with more. */
#define ONE_ROW_AHEAD 8192
static inline int64_t one_row_blocks(int64_t block_bytes) {
    int64_t b = (ONE_ROW_AHEAD + block_bytes - 1) / block_bytes;
    return b > PF_BLOCKS ? b : PF_BLOCKS;
}

/* A block's 4 weight rows from row n0: their codes, scales and zero points (NULL: none); past
   the last of `rows` rows the first again, whose results are not stored. */
static inline void block_rows(const uint8_t* codes, int64_t cstride, const float* scales,
                              const uint8_t* zeros, int64_t gstride, int64_t n0, int rows,
                              const uint8_t** wr, const float** sr, const uint8_t** zr) {
    for (int j = 0; j < 4; j++) {
        int64_t r = n0 + (j < rows ? j : 0);
        wr[j] = codes + r * cstride;
        sr[j] = scales + r * gstride;
        zr[j] = zeros ? zeros + r * gstride : NULL;
    }
}

#ifdef QBYTES
/* How far ahead one_row_u4 prefetches: the first whole block at least U4_AHEAD bytes on.
   Against one_row_blocks' 8 KB and more (AMD EPYC Zen 4, cold weights, interleaved, 1 and 2
   threads): 2 KB blocks (K = 1024) 4 KB ahead 1.2-1.3x the rate, 8 KB blocks 8 KB ahead
   1.1-1.25x, 6 KB blocks 6 KB ahead 0.95x, 24 KB blocks even; 2 KB ahead 0.75x. */
#define U4_AHEAD 4096

/* One row of x against 4-bit codes in groups of 128, the thread's share of the blocks from
   codes to stored result: in qgemv_kind's loop, where every path's state is live, GCC kept
   the pointers on the stack and ~a quarter of a hot call went outside the dot products. The
   same sums, zero points, horizontal sums and roundings as that loop: the same bits. */
static inline __attribute__((always_inline)) void one_row_u4_blocks(
    int gfni, const uint8_t* xb, const uint8_t* codes, int64_t cstride, const float* scales,
    const uint8_t* zeros, int64_t gstride, const float* xsum, float xscale, void* y,
    int out_bf16, int64_t N, int64_t K, Share* shares, int parts) {
    const int64_t block_bytes = 4 * cstride, fwd = (U4_AHEAD + block_bytes - 1) / block_bytes;
    for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
        const int64_t n0 = b * 4;
        const int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        const uint8_t* wr[4];
        const float* sr[4];
        const uint8_t* zr[4];
        block_rows(codes, cstride, scales, zeros, gstride, n0, rows, wr, sr, zr);
        Acc acc;
        block_bytes_u4_g128(gfni, xb, wr, sr, K, n0 + 4 * fwd < N ? fwd * block_bytes : 0, &acc);
        if (zeros) zero_points(sr, zr, xsum, 0, 1, K / 128, &acc);
        __m128 t = hsum4(acc.v[0][0], acc.v[1][0], acc.v[2][0], acc.v[3][0]);
        if (rows == 4) {
            store4(y, n0, _mm_mul_ps(t, _mm_set1_ps(xscale)), out_bf16);
            continue;
        }
        float out[4];
        _mm_storeu_ps(out, t);
        for (int j = 0; j < rows; j++) store(y, n0 + j, (float)(out[j] * (double)xscale), out_bf16);
    }
}

static __attribute__((noinline)) void one_row_u4(int gfni, const uint8_t* xb,
                                                 const uint8_t* codes, int64_t cstride,
                                                 const float* scales, const uint8_t* zeros,
                                                 int64_t gstride, const float* xsum,
                                                 float xscale, void* y, int out_bf16, int64_t N,
                                                 int64_t K, Share* shares, int parts) {
    if (gfni)
        one_row_u4_blocks(1, xb, codes, cstride, scales, zeros, gstride, xsum, xscale, y,
                          out_bf16, N, K, shares, parts);
    else
        one_row_u4_blocks(0, xb, codes, cstride, scales, zeros, gstride, xsum, xscale, y,
                          out_bf16, N, K, shares, parts);
}
#endif

/* 1: one row of x against 4-bit codes in groups of 128 takes one_row_u4, 0: qgemv_kind's
   loop (block_bytes). The same bits; a switch for the tests and benchmarks. */
int qgemv_one_row_u4 = 1;

/* 1: pairs of x's rows share a step of 8-bit codes in groups of 16 (block_int_g16), 0: each row
   extracts them anew. The same bits; a switch for the tests and benchmarks. */
int qgemv_g16_pairs = 1;

/* 1: one row of x runs as bytes (block_bytes) where the build has AVX512-VNNI; 0: as int16
   (block_int). A switch for the tests and benchmarks, which compare the two. */
int qgemv_byte_path = 1;
/* 1: 4-bit codes' nibbles split with GFNI (high_nibbles), 0: without; -1 until the first call
   asks the CPU. Tests set 0 to run the other path. */
int qgemv_gfni = -1;

/* The most input rows whose integer codes are extracted in registers per pair of rows
   (block_int2) rather than once per block into a scratch (block_int_many). AVX2: extracting
   again per pair (2 ops per 32 codes and weight row) costs less than the scratch's stores,
   loads and segment flushes up to 6 rows: 3-6 rows 0.84-0.97x the time, 7-8 rows 0.97-1.01x
   (int8 per channel and int4 group 128, 3072x1024 and 12288x4096, 1 thread, cold, CPU time,
   interleaved; AMD EPYC VM, Zen 1 class, avx2 fma). The AVX-512 build's scratch path
   multiplies 512 bits at a time, so it keeps the scratch from 3 rows. */
#ifdef __AVX512F__
#define INT_PAIRS_MAX 2
#define FP8_PAIRS_MAX 2
#else
#define INT_PAIRS_MAX 6
/* fp8 the same with block_fp8 (pairs converted in registers) against block_fp8_many: 3 rows
   0.81x, 4 rows 0.975x, 6 rows 1.09x, 8 rows 1.16x the time (3072x1024, as above). */
#define FP8_PAIRS_MAX 4
#endif

/* The most input rows qgemv_x8 takes (decode batches; prefill stays exact). With AVX512-VNNI
   (block_x8v): 8- and 4-bit codes, up to X8V_ROWS. Without it (block_u4x8, block_u4x8_2):
   4-bit codes only (8-bit codes times 8-bit x would overflow VPMADDUBSW's int16 pair sums);
   on AVX2 (AMD EPYC VM, Zen 1 class) 0.70-0.80x the int16 paths' time at 1-64 rows (Qwen3-0.6B
   and 8B shapes, 2 threads, cold). An AVX-512 build without VNNI takes none. */
#if defined(QBYTES)
const int qgemv_x8_rows = X8V_ROWS;
#elif defined(__AVX512VNNI__)
const int qgemv_x8_rows = 0;
#else
const int qgemv_x8_rows = 64;
#endif

/* Whether qgemv_x8 rounds x for codes of `bits` bits (8 or 4) in groups of gs features, K of
   them (minisgl/quant/cpu_gemv.py asks; attach.py's x8_takes_4_bit says the same for 4-bit
   codes): with AVX512-VNNI block_x8v's whole steps, and 4-bit codes it does not take (K =
   1088: 8.5 steps of 128) as without it (qgemv_kind's x8). */
int qgemv_x8_takes(int bits, int64_t K, int64_t gs) {
    if (gs <= 0 || K % gs || gs % 32 || !qgemv_x8_rows) return 0;
#ifdef QBYTES
    if (x8v_takes(bits == 8 ? Q_U8 : Q_U4, K, gs)) return 1;
#endif
    return bits == 4 && (gs % 64 == 0 || (gs == 32 && K % 64 == 0));
}

static void qgemv_kind(
    int kind, const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
    const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
    int64_t M, int64_t N, int64_t K, int64_t gs) {
    int64_t G = K / gs;
    int16_t* xq = NULL;
    float *xf = NULL, *xscale = NULL, *xsum = NULL;
    int* xexp = NULL;
    int bytes = 0; /* one row of x as bytes (block_bytes) */
    uint8_t* xb = NULL;
    int32_t* xcorr = NULL;
    float* xsb = NULL; /* x8: x's scale per block (x8v: per chunk and lane) */
    int x8v = 0;       /* x in 8 bits with AVX512-VNNI (block_x8v) */
    int g16 = kind == Q_U8 && gs < step_features(Q_U8); /* groups of 16: block_int_g16 */
#ifdef QBYTES
    int bkind = kind == Q_U8 ? Q_U8 : Q_U4; /* 4-bit codes in groups of 32 (Q_U4W) too */
    x8v = !g16 && qgemv_x8 && M <= X8V_ROWS && x8v_takes(kind, K, gs);
    bytes = !g16 && !x8v && qgemv_byte_path && bytes_usable(kind, M, K, gs);
    __m512i lanes = (bytes || x8v) && gs < bytes_step(bkind) ? bytes_lanes(bkind, gs)
                                                             : _mm512_setzero_si512();
    if (qgemv_gfni < 0) qgemv_gfni = cpu_gfni();
    int gfni = qgemv_gfni;
    Chunks chunks = {0, 0, 0};
    if (bytes || x8v) chunks = bytes_chunks(bkind, gs);
    if (x8v) xsb = (float*)malloc(sizeof(float) * M * (K / chunks.len) * 16);
#endif
    /* 4-bit codes against x in 8 bits (see qgemv_x8) */
    int x8 = qgemv_x8 && (kind == Q_U4 || (kind == Q_U4W && gs == 32 && K % 64 == 0)) &&
             M <= qgemv_x8_rows && !bytes && !x8v;
    if (x8) xsb = (float*)malloc(sizeof(float) * M * (K / 64));
    if (kind == Q_FP8) {
        xf = (float*)malloc(sizeof(float) * M * K);
        xexp = (int*)malloc(sizeof(int) * M);
    } else {
        xscale = (float*)malloc(sizeof(float) * M);
        xsum = (float*)malloc(sizeof(float) * M * G);
        if (bytes) {
            xb = (uint8_t*)malloc(2 * M * K);
            xcorr = (int32_t*)malloc(sizeof(int32_t) * M * (K / 64) * 16);
        } else if (x8v) { /* K bytes a row, 64-byte aligned (its loads are whole lines) */
#ifdef QBYTES /* (x8v is 0 without it) */
            xq = (int16_t*)aligned_alloc(64, x8v_xq_bytes(bkind, M, K));
#endif
        } else {
            xq = (int16_t*)malloc(sizeof(int16_t) * M * K);
        }
    }
    int64_t blocks = (N + 3) / 4;
    /* Few rows: codes turned into numbers in registers, per pass (integer codes: block_int2
       per pair of rows, block_int for a last odd one); more: once per block (integer codes
       into a scratch per segment, block_int_many; fp8 to fp32 with its scales,
       block_fp8_many) and every pass over that scratch. */
    int many = !g16 && !x8 && !x8v && !bytes &&
               M > (kind == Q_FP8 ? FP8_PAIRS_MAX : INT_PAIRS_MAX);
    int64_t steps = kind == Q_FP8 ? K / 32 * ((M + 1) / 2 + (many ? 4 : 0))
                                  : (many ? K / step_features(kind) * 4 + K / 32 * ((M + 1) / 2)
                                          : K / (x8 ? 64 : step_features(kind)) *
                                                (g16 && qgemv_g16_pairs ? (M + 1) / 2 : M));
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(shares, parts, blocks);
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
#ifdef QBYTES
            else if (bytes) quantize_x_bytes(bkind, x, x_bf16, m, K, gs, xb, xscale, xsum, xcorr);
            else if (x8v)
                quantize_x8v(bkind, x, x_bf16, m, M, K, gs, chunks, lanes, (int8_t*)xq, xsb,
                             xscale, xsum);
#endif
            else if (x8) quantize_x8(x, x_bf16, m, K, gs, (int8_t*)xq, xsb, xscale, xsum);
            else quantize_x(kind, x, x_bf16, m, K, gs, xq, xscale, xsum);
        }
#ifdef QBYTES
        if (bytes && M == 1 && bkind == Q_U4 && gs == 128 && qgemv_one_row_u4) {
            one_row_u4(gfni, xb, codes, cstride, scales, zeros, gstride, xsum, xscale[0], y,
                       out_bf16, N, K, shares, parts);
            goto done;
        }
#endif
        /* fp8: [4][KC] fp32; integer codes: [4][SEG] int16 */
        void* scratch = many ? aligned_alloc(64, kind == Q_FP8 ? sizeof(float) * 4 * KC
                                                               : sizeof(int16_t) * 4 * SEG)
                             : NULL;
        Acc* accs = many || x8v || (bytes && M > 1)
                        ? (Acc*)aligned_alloc(64, sizeof(Acc) * ((M + 1) / 2))
                        : NULL;
#ifdef QBYTES
        __m512* x8f = x8v ? (__m512*)aligned_alloc(64, sizeof(__m512) * 4 * M) : NULL;
#endif
        /* the blocks shared as the bf16 GEMV shares them (common.h): a run per thread, then
           the ends of the others' runs, so a thread slowed by other work on its core holds
           the call up for the block in hand only */
        for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            int64_t n0 = b * 4;
            int rows = N - n0 < 4 ? (int)(N - n0) : 4;
            const uint8_t* wr[4];
            const float* sr[4];
            const uint8_t* zr[4];
            block_rows(codes, cstride, scales, zeros, gstride, n0, rows, wr, sr, zr);
            int64_t block_bytes = 4 * cstride;
            Prefetch pf = {ahead(codes + n0 * cstride, block_bytes, n0 + 4 * PF_BLOCKS < N),
                           block_bytes / 64, steps, 0, 0};
            /* one row on the byte path: bytes from a row to the same row of the block it
               prefetches (0: none, past the last block) */
            const int64_t one_blocks = one_row_blocks(block_bytes);
            const int64_t one_ahead = n0 + 4 * one_blocks < N ? one_blocks * block_bytes : 0;
            (void)one_ahead;
            if (many) run_block(kind, 1, xq, xf, wr, sr, 0, M, K, gs, &pf, scratch, accs);
#ifdef QBYTES
            if (bytes && M > 1)
                run_bytes_many(bkind, gfni, xb, xcorr, wr, sr, M, K, chunks,
                               pf.base ? PF_BLOCKS * block_bytes : 0, lanes, accs);
            if (x8v)
                run_x8v(bkind, gfni, (const int8_t*)xq, xsb, wr, sr, M, K, chunks,
                        pf.base ? PF_BLOCKS * block_bytes : 0, lanes, x8f, accs);
#endif
            /* one group a row (per channel) on a whole block: the zero points' terms of the 4
               rows as one vector after the horizontal sums, not zero_points' scalar loop per
               row (~5% of a hot int8 call's time) */
            int zero4 = kind != Q_FP8 && zeros && G == 1 && rows == 4;
            __m128 sz = _mm_setzero_ps();
            if (zero4)
                sz = _mm_mul_ps(_mm_setr_ps(sr[0][0], sr[1][0], sr[2][0], sr[3][0]),
                                _mm_setr_ps((float)zr[0][0], (float)zr[1][0], (float)zr[2][0],
                                            (float)zr[3][0]));
            for (int64_t m = 0; m < M; m += 2) {
                Acc one;
                Acc* acc = accs ? &accs[m / 2] : &one;
                int mr = M - m >= 2 ? 2 : 1;
#ifdef QBYTES
                if (x8v || (bytes && M > 1)) {
                } else if (bytes && bkind == Q_U8 && qgemv_rows_seq)
                    block_bytes_u8_runs(xb, xcorr, wr, sr, K, chunks, one_ahead, lanes, acc);
                else if (bytes)
                    run_bytes(bkind, gfni, xb, xcorr, wr, sr, K, chunks, one_ahead, lanes, acc);
                else
#endif
                if (x8 && mr == 2) block_u4x8_2((const int8_t*)xq, xsb, wr, sr, m, K, gs, &pf, acc);
                else if (x8) block_u4x8((const int8_t*)xq, xsb, wr, sr, m, K, gs, &pf, acc);
                else if (g16 && mr == 2 && qgemv_g16_pairs)
                    block_int_g16(2, xq, wr, sr, m, 0, K, &pf, acc);
                else if (g16)
                    for (int i = 0; i < mr; i++)
                        block_int_g16(1, xq, wr, sr, m + i, i, K, &pf, acc);
                else if (!many) run_block(kind, 0, xq, xf, wr, sr, m, M, K, gs, &pf, NULL, acc);
                if (kind != Q_FP8 && zeros && !zero4) zero_points(sr, zr, xsum, m, mr, G, acc);
                for (int i = 0; i < mr; i++) {
                    __m128 t = hsum4(acc->v[0][i], acc->v[1][i], acc->v[2][i], acc->v[3][i]);
                    if (zero4) t = _mm_sub_ps(t, _mm_mul_ps(sz, _mm_set1_ps(xsum[m + i])));
                    if (kind != Q_FP8 && rows == 4) { /* the same roundings, 4 lanes at once */
                        store4(y, (m + i) * N + n0, _mm_mul_ps(t, _mm_set1_ps(xscale[m + i])),
                               out_bf16);
                        continue;
                    }
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
#ifdef QBYTES
        free(x8f);
#endif
#ifdef QBYTES
    done:
#endif
        _mm_setcsr(csr);
    }
    free(xq);
    free(xsb);
    free(xb);
    free(xcorr);
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
                    w0 = e4m3x8_low(v);
                    w1 = e4m3x8_low(_mm_unpackhi_epi64(v, v));
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
