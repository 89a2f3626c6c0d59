/* The machine's roofline, for the benchmarks to report: read bandwidth and FMA issue rate. */
#include "common.h"

/* Read bandwidth: every thread sums its share of a buffer far larger than the caches, with four
   independent accumulators so the adds never limit the loads. n % 32 == 0. */
float stream_read(const float* p, int64_t n) {
    float total = 0.f;
    #pragma omp parallel reduction(+ : total)
    {
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 32) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
            b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
            c = _mm256_add_ps(c, _mm256_loadu_ps(p + i + 16));
            d = _mm256_add_ps(d, _mm256_loadu_ps(p + i + 24));
        }
        total += hsum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    }
    return total;
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
