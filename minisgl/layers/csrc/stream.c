/* The machine's read bandwidth, for the roofline the benchmarks report: every thread sums its
   share of a buffer far larger than the caches, with four independent accumulators so the
   adds never limit the loads. n % 32 == 0. */
#include "common.h"

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
