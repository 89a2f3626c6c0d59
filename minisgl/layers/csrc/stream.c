/* The machine's roofline, for the benchmarks to report: read bandwidth and FMA issue rate. */
#include "common.h"

#include <cpuid.h>

/* Read bandwidth: every thread sums its share (schedule(static): one contiguous run, as the
   matmuls read theirs) of a buffer far larger than the caches, with four independent
   accumulators so the adds never limit the loads, at the build's vector width (64-byte loads,
   one cache line each, in the AVX-512 build; `narrow`: 32-byte loads there too). `ahead` > 0:
   each line `ahead` bytes past the read is also prefetched by hand (into L1 where `l2` is 0,
   else into L2), as the GEMV and panel kernels do; 0: the hardware prefetcher alone. Any n
   (the last values one at a time). */
#define STREAM_LOOP(V, ZERO, LOAD, ADD, SUM)                                                   \
    {                                                                                          \
        const int64_t w = (int64_t)(sizeof(V) / sizeof(float)), step = 4 * w;                \
        whole = n - n % step;                                                                  \
        _Pragma("omp parallel reduction(+ : total)") {                                         \
            V a = ZERO(), b = a, c = a, d = a;                                                 \
            if (pf <= 0) {                                                                     \
                _Pragma("omp for schedule(static)") for (int64_t i = 0; i < whole; i += step) {\
                    STREAM_ADDS(LOAD, ADD);                                                    \
                }                                                                              \
            } else if (l2) {                                                                   \
                _Pragma("omp for schedule(static)") for (int64_t i = 0; i < whole; i += step) {\
                    STREAM_PREFETCH(_MM_HINT_T1);                                              \
                    STREAM_ADDS(LOAD, ADD);                                                    \
                }                                                                              \
            } else {                                                                           \
                _Pragma("omp for schedule(static)") for (int64_t i = 0; i < whole; i += step) {\
                    STREAM_PREFETCH(_MM_HINT_T0);                                              \
                    STREAM_ADDS(LOAD, ADD);                                                    \
                }                                                                              \
            }                                                                                  \
            total += SUM(ADD(ADD(a, b), ADD(c, d)));                                           \
        }                                                                                      \
    }
#define STREAM_ADDS(LOAD, ADD)                                                                 \
    a = ADD(a, LOAD(p + i));                                                                   \
    b = ADD(b, LOAD(p + i + w));                                                               \
    c = ADD(c, LOAD(p + i + 2 * w));                                                           \
    d = ADD(d, LOAD(p + i + 3 * w))
/* The lines iteration i reads, `pf` floats on (none past the buffer). */
#define STREAM_PREFETCH(hint)                                                                  \
    if (i + pf < whole)                                                                        \
        for (int64_t o = 0; o < step * (int64_t)sizeof(float); o += 64)                        \
            _mm_prefetch((const char*)(p + i + pf) + o, hint)

float stream_read_ahead(const float* p, int64_t n, int64_t ahead, int l2, int narrow) {
    float total = 0.f;
    int64_t pf = ahead / (int64_t)sizeof(float), whole = 0;
#ifdef __AVX512F__
    if (!narrow)
        STREAM_LOOP(__m512, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_add_ps,
                    _mm512_reduce_add_ps)
    else
#endif
        STREAM_LOOP(__m256, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_add_ps, hsum)
    (void)narrow;
    for (int64_t i = whole; i < n; i++) total += p[i];
    return total;
}

/* The plain loop at the build's width (no hand prefetch): what the other kernels' callers use
   to evict caches. */
float stream_read(const float* p, int64_t n) { return stream_read_ahead(p, n, 0, 0, 0); }

/* Every cache line of [p, p + bytes) out of every cache level (CLFLUSH: clean lines are
   dropped, none is written back for read-only weights): the kernel chooser's timing passes then
   read their weights from memory, as a decode step does, whatever the size of the last-level
   cache (a pass over 48 MB of weights ran from a Xeon VM's 480 MB L3 at 1.9x the rate of the
   same kernel in a step). */
__attribute__((target("clflushopt"))) static void flush_opt(const char* c, int64_t lines) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < lines; i++) _mm_clflushopt(c + 64 * i);
}

void flush_lines(const void* p, int64_t bytes) {
    const char* c = (const char*)((uintptr_t)p & ~(uintptr_t)63);
    int64_t lines = ((const char*)p + bytes - c + 63) / 64;
    unsigned a, b = 0, d, x;
    if (__get_cpuid_count(7, 0, &a, &b, &x, &d) && (b >> 23 & 1)) /* CLFLUSHOPT: unordered */
        flush_opt(c, lines);
    else {
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < lines; i++) _mm_clflush(c + 64 * i);
    }
    _mm_mfence();
}

/* fp32 FMA issue rate, at the vector width of this build: every thread runs `iters` rounds of
   12 independent multiply-add chains (more than FMA latency x FMA units on the CPUs seen, so
   the units never wait for a result). Returns the FLOPs done; *sink gets a value that depends
   on every chain, so none of the work can be dropped. */
#ifdef __AVX512F__
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define SUM(v) hsum(v)
#endif
#define CHAINS 12
int64_t fma_peak(int64_t iters, float* sink) {
    float total = 0.f;
    int64_t threads = 1;
    #pragma omp parallel reduction(+ : total)
    {
        #pragma omp single
        threads = omp_get_num_threads();
        vec a[CHAINS], m = SET1(0.999f), c = SET1(1e-4f);
        for (int i = 0; i < CHAINS; i++) a[i] = SET1((float)i);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = FMA(a[i], m, c);
        for (int i = 1; i < CHAINS; i++) a[0] = ADD(a[0], a[i]);
        total += SUM(a[0]);
    }
    *sink = total;
    return threads * iters * CHAINS * (int64_t)(sizeof(vec) / sizeof(float)) * 2;
}
