/* Shared by every CPU kernel file: 8-lane fp32 loads of bf16/fp32 data, sums, bf16 rounding,
   a vector exp and hand prefetching. Compiled into each ISA's build (AVX2 or AVX-512, see
   minisgl/layers/cpu_build.py); the AVX2 intrinsics here run on both. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* Elementwise kernels split their rows over the threads from this many values (of the rows
   they read), one figure per kernel family: set when the library loads, from the fork-and-join
   cost of the threads measured on the running machine against the kernel's own rate
   (cpu_kernels.py), so a B=1 step's small rows never wake the other threads. Until then: never. */
extern int64_t norm_parallel_min, silu_parallel_min;

static inline __m256 load_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }
/* v's bits plus the round-to-nearest-even bias (0x7FFF, + 1 where bit 16 is set): the top
   half of each lane is then v rounded to bf16 (the bottom half is left over). */
static inline __m256i bias8_bf16(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
}
static inline __m256 round8_bf16(__m256 v) { /* to the nearest bf16, ties to even */
    __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    return _mm256_castsi256_ps(_mm256_and_si256(bias8_bf16(v), top));
}
#if defined(__AVX512F__)
/* 16 values of x (bf16 where x_bf16, else fp32) from element `at`, as fp32: bf16 widened
   exactly (the quantized kernels' x, qgemv.c and qvnni.c). */
static inline __m512 load16_x(const void* x, int x_bf16, int64_t at) {
    if (!x_bf16) return _mm512_loadu_ps((const float*)x + at);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* bias8_bf16 on 16 lanes; a mask instead of a shift and an and: one op fewer. */
static inline __m512i bias16_bf16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __mmask16 odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x10000));
    b = _mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF));
    return _mm512_mask_add_epi32(b, odd, b, _mm512_set1_epi32(1));
}
/* 16 fp32 values as bf16, to the nearest, ties to even (bias16_bf16's bits: no AVX512-BF16
   needed). */
static inline __m256i pack16_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bias16_bf16(v), 16));
}
/* n bf16 values at x (n % 16 == 0) widened, exactly, to fp32 at out (64-byte aligned): x for
   the FMA kernels where the CPU lacks AVX512-BF16. */
static inline void widen_bf16(const void* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i += 16) _mm512_store_ps(out + i, load16_x(x, 1, i));
}
/* exp8 (below) on 16 lanes: the same arithmetic, so the same bits (SiLU, softmax). */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                     _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    /* y * 2^fx in one op (exp8 builds 2^fx from its bits and multiplies: exact either way,
       fx an integer in [-126, 127] here): SiLU 1.08x in cache. */
    return _mm512_scalef_ps(y, fx);
}

/* 2^t on 16 lanes for t <= 0 (below -126 taken as -126, so the result stays a normal float):
   2^round(t) (VSCALEFPS) times 2^f, f in [-0.5, 0.5], by a degree-5 polynomial (Chebyshev
   fit; relative error < 2.5e-7 in fp32, exp16's accuracy). Where the caller scales by log2(e)
   beforehand it is an exp in 10 ops against exp16's 15. */
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.3400433e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6760374e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5503272e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022107e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001f));
    return _mm512_scalef_ps(y, n);
}

/* r[i] dword j -> r[j] dword i (16 x 16 dwords). */
static inline __attribute__((always_inline)) void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane L of r[4a + b] now holds column 4L'... of rows 4a..4a+3: regroup lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float v) {
    uint32_t b;
    __builtin_memcpy(&b, &v, 4);
    b += 0x7FFF + ((b >> 16) & 1);
    return (uint16_t)(b >> 16);
}
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline float id_f32(float v) { return v; }

static inline void store(void* y, int64_t i, float v, int out_bf16) {
    if (out_bf16) ((uint16_t*)y)[i] = f32_to_bf16(v); /* to the nearest, ties to even */
    else ((float*)y)[i] = v;
}

/* Weights are streamed from memory once per call in 4-row blocks, and each block's rows are
   short streams (2 KB at K=1024) that the hardware prefetcher barely learns before they end:
   reading PF_BLOCKS blocks ahead by hand keeps the memory busy while the current block is
   multiplied (measured: M=1 from ~20 to ~25 GB/s; M=8 no longer pays memory and FMA time one
   after the other). */
#define PF_BLOCKS 2
static inline const char* ahead(const void* block, int64_t block_bytes, int ok) {
    return ok ? (const char*)block + PF_BLOCKS * block_bytes : 0;
}
/* `n` cache lines from byte `off` of `base`: one k step consumes 4 rows x its bytes, so the
   prefetch advances through the next blocks as fast as the current one is read. */
static inline void prefetch_lines(const char* base, int64_t off, int n) {
    for (int i = 0; i < n; i++) _mm_prefetch(base + off + 64 * i, _MM_HINT_T0);
}

/* Spreads the prefetch of the next blocks over every pass a block takes: with several input
   rows the block is read from L1 once per pair of rows, and prefetching only during the first
   pass would leave the memory idle for the others (measured: M=8 took memory time plus FMA
   time). Each k-step of any pass earns `lines` credits, a line costs `steps` (the k-steps of
   all passes), so the block's lines are all issued by its last step. */
typedef struct {
    const char* base;
    int64_t lines, steps, issued, credit;
} Prefetch;

static inline void prefetch_step(Prefetch* p) { /* no division: this runs every k-step */
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps)
        _mm_prefetch(p->base + 64 * p->issued++, _MM_HINT_T0);
}

/* How the matmuls share their items (weight blocks, panels) among the threads. Each thread
   starts on its own contiguous run of the items, in order, as schedule(static) would (one
   memory stream per thread, the prefetch running on into its next item); a thread out of work
   then takes items one at a time from the end of a run still being worked on. A call thus no
   longer waits for the slowest thread's whole half: when another process slows or holds a
   core for a while, the other thread does the rest of the work instead of idling at the join
   (the join itself still waits for the held thread's item in hand). On an idle machine the
   runs end together and it is schedule(static). One item per claim: a compare-and-swap on a
   line its owner mostly holds. */
#define SHARE_MAX 64
typedef struct {
    uint64_t word; /* next item (low 32 bits), end of the run (high 32) */
    char pad[56];
} Share;

/* Runs for `parts` threads over items [0, n) (n < 2^31). */
static inline void shares_init(Share* s, int parts, int64_t n) {
    for (int t = 0; t < parts; t++)
        s[t].word = ((uint64_t)(n * (t + 1) / parts) << 32) | (uint64_t)(n * t / parts);
}

static inline int64_t share_front(Share* s) {
    uint64_t v = __atomic_load_n(&s->word, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t next = (uint32_t)v, end = (uint32_t)(v >> 32);
        if (next >= end) return -1;
        if (__atomic_compare_exchange_n(&s->word, &v, v + 1, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return next;
    }
}

static inline int64_t share_back(Share* s) {
    uint64_t v = __atomic_load_n(&s->word, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t next = (uint32_t)v, end = (uint32_t)(v >> 32);
        if (next >= end) return -1;
        if (__atomic_compare_exchange_n(&s->word, &v, v - (1ull << 32), 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return end - 1;
    }
}

/* Thread t's next item: its own run front to back, then the others' from their ends; -1 when
   every item is taken. */
static inline int64_t share_next(Share* s, int parts, int t) {
    int64_t i = share_front(&s[t % parts]);
    for (int o = 1; i < 0 && o < parts; o++) i = share_back(&s[(t + o) % parts]);
    return i;
}

/* The number of runs for a call: one per thread the next parallel region may have. */
static inline int share_parts(void) {
    int n = omp_get_max_threads();
    return n < 1 ? 1 : (n > SHARE_MAX ? SHARE_MAX : n);
}


/* expf on 8 lanes (Cephes' polynomial after n*ln2 range reduction; ~1 ulp) for x <= 88. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* Four horizontal sums at once: [sum(a), sum(b), sum(c), sum(d)]. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* An 8x8 transpose in registers into a 16-wide panel: dst[j * 16 + i] = r[i][j]. */
static inline void transpose8_store(const __m256* r, float* dst) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* A quantized weight's group mins (GGUF's K-quants: weight = (code - zero) * scale - min), as
   qmins.c and qamx.c's *_mins read them: fp32 [N, G] (d null; row stride `stride`), or, for
   the K-quants whose mins are a super-block's dmin times a small integer m (Q4_K, Q5_K: 6 bits
   a group of 32; Q2_K: 4 bits a group of 16), m as u8 [N, G] (row stride `stride`) with dmin
   fp32 [N, G / per] (row stride dstride; per = 2^shift): 1 + 4 / per bytes a group where fp32
   took 4. The product dmin * m (an fp16 times at most 63) is exact in fp32, so both forms give
   every min, and every result, the same bits. */
typedef struct {
    const void* m;
    const float* d;
    int64_t stride, dstride, shift; /* a shift, not a division: this runs every 8 mins */
} Mins;

/* Mins of the C entry points' arguments (per: a power of 2, >= 8, where mscale is given). */
static inline Mins mins_of(const void* m, int64_t stride, const float* d, int64_t dstride,
                           int64_t per) {
    return (Mins){m, d, stride, dstride, d ? __builtin_ctzll((unsigned long long)per) : 0};
}

static inline float min_at(const Mins* s, int64_t n, int64_t g) {
    if (!s->d) return ((const float*)s->m)[n * s->stride + g];
    float d = s->d[n * s->dstride + (g >> s->shift)];
    return d * (float)((const uint8_t*)s->m)[n * s->stride + g];
}
/* Groups g .. g + 7 of row n (g % 8 == 0; the compact form: per % 8 == 0, so one dmin), the
   form a constant at the call (s->d set where `compact`), so each form's loop has no test. */
static inline __attribute__((always_inline)) __m256 min8(const Mins* s, int64_t n, int64_t g,
                                                         const int compact) {
    if (!compact) return _mm256_loadu_ps((const float*)s->m + n * s->stride + g);
    __m128i b = _mm_loadl_epi64((const __m128i*)((const uint8_t*)s->m + n * s->stride + g));
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    return _mm256_mul_ps(_mm256_set1_ps(s->d[n * s->dstride + (g >> s->shift)]), m);
}
