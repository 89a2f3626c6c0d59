/* Per-row reductions over a batch's fp32 logits [R, V], one pass each, rows split across
   threads: the best token (greedy decoding, and the NaN/inf check of every row), and the
   log-normaliser plus the top-k (log-probabilities). torch's max-with-index reduction over a
   150k vocabulary is not vectorised (~10x slower than this), and log_softmax + topk write
   and re-read a [R, V] tensor that is never needed. */
#include "common.h"

/* The largest value of row[0..V) but NaNs, the first index of it, and whether a NaN was seen
   (rows_argmax then makes the row's value NaN, so the caller sees a row with no distribution,
   as torch.max does). Four independent running maxima of 8 lanes each (index v of the row in
   lane v % 8 of accumulator (v / 8) % 4): one accumulator's compare-and-blend waits on the
   last one's result, so a single one ran at its latency (~5 cycles per 8 values; 4 keep the
   vector units busy: a 151936-wide row ~4x faster, one thread, AMD EPYC Zen 4). Within a lane
   the strict compare keeps the first index of its maximum; across lanes the lowest index among
   equal maxima wins. */
static void argmax_part(const float* row, int64_t V, float* vmax, int64_t* imax,
                        int* has_nan) {
    __m256 best[4], nan = _mm256_setzero_ps();
    __m256i best_i[4], idx[4];
    const __m256i step = _mm256_set1_epi32(32);
    for (int a = 0; a < 4; a++) {
        best[a] = _mm256_set1_ps(-INFINITY);
        best_i[a] = _mm256_set1_epi32(0);
        idx[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                  _mm256_set1_epi32(8 * a));
    }
    int64_t v = 0;
    for (; v + 32 <= V; v += 32) {
        for (int a = 0; a < 4; a++) {
            __m256 x = _mm256_loadu_ps(row + v + 8 * a);
            __m256 gt = _mm256_cmp_ps(x, best[a], _CMP_GT_OQ); /* strict: the first index wins */
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            best[a] = _mm256_blendv_ps(best[a], x, gt);
            best_i[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i[a]),
                                                             _mm256_castsi256_ps(idx[a]), gt));
            idx[a] = _mm256_add_epi32(idx[a], step);
        }
    }
    float m = -INFINITY;
    int64_t at = 0;
    int seen = 0;
    for (int a = 0; a < 4 && v > 0; a++) {
        float bv[8];
        int32_t bi[8];
        _mm256_storeu_ps(bv, best[a]);
        _mm256_storeu_si256((__m256i*)bi, best_i[a]);
        for (int l = 0; l < 8; l++) {
            if (!seen || bv[l] > m || (bv[l] == m && bi[l] < at)) {
                m = bv[l];
                at = bi[l];
                seen = 1;
            }
        }
    }
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; v < V; v++) {
        if (row[v] != row[v]) any_nan = 1;
        if (!seen || row[v] > m) {
            m = row[v];
            at = v;
            seen = 1;
        }
    }
    *vmax = m;
    *imax = at;
    *has_nan = any_nan;
}

/* Values per thread from which a row is split among the threads when there are fewer rows
   than threads. A decode step of one request scanned its 151936 logits on one thread in ~90
   us (Qwen3-0.6B, int4, AMD EPYC Zen 4): the LM head had streamed its weights past them, so
   they came from memory, at a rate one core's reads alone do not reach; split over 2 threads
   ~65 us (608 KB written, then 64 MB streamed: 52-60 -> 37-40 us). */
#define ARGMAX_PART 8192
#define ARGMAX_PARTS_MAX 64 /* rows x parts of a split call */

void rows_argmax(const float* x, int64_t R, int64_t V, float* vmax, int64_t* imax) {
    int64_t P = omp_get_max_threads() / (R > 0 ? R : 1); /* parts a row */
    if (P > V / ARGMAX_PART) P = V / ARGMAX_PART;
    if (P * R > ARGMAX_PARTS_MAX) P = ARGMAX_PARTS_MAX / R;
    if (P < 2) {
        #pragma omp parallel for schedule(static) if (R > 1)
        for (int64_t r = 0; r < R; r++) {
            int nan;
            argmax_part(x + r * V, V, vmax + r, imax + r, &nan);
            if (nan) vmax[r] = NAN;
        }
        return;
    }
    const int64_t len = (V / P + 31) & ~(int64_t)31; /* whole passes of 32 but the last part's */
    float pm[ARGMAX_PARTS_MAX];
    int64_t pi[ARGMAX_PARTS_MAX];
    int pn[ARGMAX_PARTS_MAX];
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < R * P; j++) {
        int64_t r = j / P, lo = (j % P) * len, hi = j % P == P - 1 ? V : lo + len;
        argmax_part(x + r * V + lo, hi - lo, pm + j, pi + j, pn + j);
        pi[j] += lo;
    }
    /* The parts in index order: a later one wins only with a larger value, so the first index
       of the maximum stays, as in one pass. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t j0 = r * P;
        float m = pm[j0];
        int64_t at = pi[j0];
        int nan = pn[j0];
        for (int64_t j = j0 + 1; j < j0 + P; j++) {
            nan |= pn[j];
            if (pm[j] > m) {
                m = pm[j];
                at = pi[j];
            }
        }
        vmax[r] = nan ? NAN : m;
        imax[r] = at;
    }
}

/* Insert (value, index) into the descending list of the k best so far (k >= 1). */
static void topk_insert(float* tv, int64_t* ti, int k, int* n, float value, int64_t index) {
    int pos = *n < k ? (*n)++ : k - 1;
    while (pos > 0 && tv[pos - 1] < value) {
        tv[pos] = tv[pos - 1];
        ti[pos] = ti[pos - 1];
        pos--;
    }
    tv[pos] = value;
    ti[pos] = index;
}

/* log(sum(exp(row))) and the k largest (value, index), in descending value order with the
   lower index first among equals. The sum is kept in double: 150k fp32 terms summed in fp32
   would lose ~1e-4 of the total. */
static void logprob_row(const float* row, int64_t V, int k, float* lse, float* tv, int64_t* ti) {
    int n = 0;
    float threshold = -INFINITY; /* the k-th best once k are known */
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 x = _mm256_loadu_ps(row + v);
        mx = _mm256_max_ps(mx, x);
        if (k > 0) {
            int mask = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(threshold), _CMP_GT_OQ));
            if (n < k) mask = 0xFF; /* still filling: every value is a candidate */
            while (mask) {
                int l = __builtin_ctz(mask);
                mask &= mask - 1;
                float value = row[v + l];
                if (n < k || value > threshold) {
                    topk_insert(tv, ti, k, &n, value, v + l);
                    if (n == k) threshold = tv[k - 1];
                }
            }
        }
    }
    float m = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (int64_t t = v; t < V; t++) {
        m = row[t] > m ? row[t] : m;
        if (k > 0 && (n < k || row[t] > threshold)) {
            topk_insert(tv, ti, k, &n, row[t], t);
            if (n == k) threshold = tv[k - 1];
        }
    }
    if (!(m > -INFINITY) || m == INFINITY) { /* nothing finite, or +inf: no distribution */
        *lse = m == INFINITY ? INFINITY : NAN;
        return;
    }
    __m256 shift = _mm256_set1_ps(m);
    __m256d s0 = _mm256_setzero_pd(), s1 = s0;
    for (v = 0; v + 8 <= V; v += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + v), shift));
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double parts[4];
    _mm256_storeu_pd(parts, _mm256_add_pd(s0, s1));
    double sum = parts[0] + parts[1] + parts[2] + parts[3];
    for (; v < V; v++) sum += exp((double)row[v] - m);
    *lse = (float)((double)m + log(sum));
}

/* Rows `rows[0..R)` of x [*, V] (or the first R rows when `rows` is NULL). */
void rows_logprob(const float* x, const int64_t* rows, int64_t R, int64_t V, int k, float* lse,
                  float* topv, int64_t* topi) {
    int64_t kk = k > 0 ? k : 1;
    #pragma omp parallel for schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++)
        logprob_row(x + (rows ? rows[r] : r) * V, V, k, lse + r, topv + r * kk, topi + r * kk);
}

/* Top-p without a sort. The cutoff of a row is the smallest probability the nucleus keeps: the
   k-th largest, for the smallest k whose k best reach `top_p` of the mass. Probabilities are
   non-negative floats, whose bit patterns sort as integers, so the cutoff is found by a radix
   select: mass histograms over 12, then 10, then 10 bits of the pattern, each pass walking
   from the top bucket down until the mass reaches top_p and refining only the bucket where
   it did. Three passes over the row instead of sorting 150k values (~100x faster). Ties at the
   cutoff are all kept. Rows with top_p >= 1 get 0 (keep everything). */
static float nucleus_row(const float* p, int64_t V, double top_p) {
    static const int shift[3] = {20, 10, 0};
    static const int width[3] = {4096, 1024, 1024};
    double mass[4096];
    double before = 0.0; /* mass of every bucket above the one being refined */
    uint32_t prefix = 0;
    const uint32_t* bits = (const uint32_t*)p;
    for (int level = 0; level < 3; level++) {
        int n = width[level];
        for (int b = 0; b < n; b++) mass[b] = 0.0;
        uint32_t high = level == 0 ? 0 : prefix >> shift[level - 1];
        for (int64_t v = 0; v < V; v++) {
            uint32_t u = bits[v];
            if (level > 0 && (u >> shift[level - 1]) != high) continue;
            mass[(u >> shift[level]) & (uint32_t)(n - 1)] += p[v];
        }
        int found = -1, lowest = -1;
        for (int b = n - 1; b >= 0; b--) {
            if (mass[b] <= 0.0) continue;
            lowest = b;
            if (before + mass[b] >= top_p) {
                found = b;
                break;
            }
            before += mass[b];
        }
        if (found < 0) found = lowest < 0 ? 0 : lowest; /* rounding left top_p unreached */
        prefix |= (uint32_t)found << shift[level];
    }
    float cutoff;
    __builtin_memcpy(&cutoff, &prefix, 4);
    return cutoff;
}

void rows_nucleus_cutoff(const float* p, int64_t R, int64_t V, const float* top_p, float* out) {
    #pragma omp parallel for schedule(dynamic, 1) if (R > 1)
    for (int64_t r = 0; r < R; r++)
        out[r] = top_p[r] < 1.0f ? nucleus_row(p + r * V, V, top_p[r]) : 0.0f;
}
