/* A mixture-of-experts layer's expert MLPs at decode, bf16 weights, as one call.

   Per layer a decode step runs, for each expert some token chose, w13 [2I, H] (gate and up),
   SiLU and w2 [H, I]: at batch 1 that is 8 experts of 128 for Qwen3-30B-A3B, 16 GEMVs of
   3-6 MB. As separate calls each is a fork and join of the threads, and each starts its memory
   stream cold: the prefetch that keeps the memory busy runs only within one weight. Here the
   4-row blocks of all the chosen experts' w13 are one list the threads share, then those of
   their w2, in one parallel region; the prefetch runs on across expert boundaries.

   Every block is gemv_bf16's (gemv.h) on the rows that chose its expert, the SiLU is
   silu_mul's, and the router's weighting sums each token's experts in slot order in fp32 as
   fused_moe's torch ops do: the result is the same bits as the per-expert loop's. */
#include "gemv.h"

#include <math.h>
#include <string.h>

void silu_mul_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t I);
void silu_mul_f32(const float* x, float* out, int64_t M, int64_t I);
int qmins(const void* x, int x_bf16, const float* acc, const void* mins, int64_t gstride,
          const float* mscale, int64_t sstride, int64_t per, void* y, int y_bf16, int64_t M,
          int64_t N, int64_t K, int64_t gs);

/* The experts with rows, ascending: expert[g]'s rows are [start[g], start[g] + count[g]) of
   the (token, slot) pairs sorted by expert, stably (fused_moe's _group_by_expert): sorted row r
   is pair order[r], and pair i is sorted row pos[i]. */
typedef struct {
    int64_t n;
    int64_t *expert, *start, *count, *order, *pos;
} Groups;

/* ids [R]: each pair's expert, all in [0, E) (checked by the caller). A counting sort. */
static Groups groups_of(const int64_t* ids, int64_t R, int64_t E) {
    int64_t* rows = calloc(E + 1, sizeof(int64_t)); /* per expert, then where its rows start */
    for (int64_t i = 0; i < R; i++) rows[ids[i] + 1]++;
    int64_t most = R < E ? R : E; /* groups */
    Groups g = {0, malloc(sizeof(int64_t) * (3 * most + 2 * R + 1)), 0, 0, 0, 0};
    g.start = g.expert + most;
    g.count = g.start + most;
    g.order = g.count + most;
    g.pos = g.order + R;
    for (int64_t e = 0; e < E; e++) {
        if (rows[e + 1]) {
            g.expert[g.n] = e;
            g.start[g.n] = rows[e];
            g.count[g.n++] = rows[e + 1];
        }
        rows[e + 1] += rows[e];
    }
    for (int64_t i = 0; i < R; i++) {
        int64_t r = rows[ids[i]]++;
        g.order[r] = i;
        g.pos[i] = r;
    }
    free(rows);
    return g;
}

/* -1, or the first (token, slot) pair whose expert is not in [0, E). */
static int64_t bad_id(const int64_t* ids, int64_t R, int64_t E) {
    for (int64_t i = 0; i < R; i++)
        if (ids[i] < 0 || ids[i] >= E) return i;
    return -1;
}

/* Both forms' per-row buffers in the activations' dtype (`size` bytes a value): the gate/up
   outputs [R, 2I], the SiLU's [R, I] and the experts' outputs [R, H]. */
typedef struct {
    char *h13, *h, *ys;
} Hidden;

static Hidden hidden_alloc(int64_t R, int64_t H, int64_t I, int64_t size) {
    return (Hidden){malloc(size * R * 2 * I), malloc(size * R * I), malloc(size * R * H)};
}

static void release(Hidden* b, void* xs, Groups* g) {
    free(b->ys);
    free(b->h);
    free(b->h13);
    free(xs);
    free(g->expert);
}

/* One weight per expert ([E, N, K], bf16) against the grouped rows: block b of the list is
   block b % blocks of group b / blocks's expert. */
typedef struct {
    const uint16_t* w;
    int64_t N, K, blocks;
    const float* xs; /* the split input rows [R, K] */
    void* y;         /* [R, N] */
} Pass;

static const uint16_t* block_at(const Pass* p, const Groups* g, int64_t b) {
    return p->w + (g->expert[b / p->blocks] * p->N + b % p->blocks * 4) * p->K;
}

/* This thread's share of one pass's blocks; the prefetch of block b + PF_BLOCKS, in whichever
   expert it lies. */
static void run_pass(const Pass* p, const Groups* g, Share* shares, int parts, int out_bf16) {
    int64_t total = g->n * p->blocks;
    for (int64_t b; (b = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
        int64_t grp = b / p->blocks, n0 = b % p->blocks * 4;
        int rows = p->N - n0 < 4 ? (int)(p->N - n0) : 4;
        int64_t next = b + PF_BLOCKS;
        Prefetch pf = gemv_bf16_prefetch(next < total ? block_at(p, g, next) : 0,
                                         g->count[grp], p->K);
        gemv_bf16_block(p->xs + g->start[grp] * p->K, block_at(p, g, b), rows, p->y,
                        g->start[grp], p->N, n0, g->count[grp], p->K, &pf, out_bf16);
    }
}

/* out[t] = sum over slots j of weights[t, j] * ys[row of (t, j)], j in order, in fp32, rounded
   once. The product is kept apart from the sum (no fused multiply-add): torch rounds both. */
static void weigh_and_sum(const void* ys, const int64_t* pos, const void* weights, int w_bf16,
                          void* out, int64_t T, int64_t k, int64_t H, int bf) {
    int64_t chunks = H / 8;
    #pragma omp for schedule(static)
    for (int64_t c = 0; c < T * chunks; c++) {
        int64_t t = c / chunks, h = c % chunks * 8;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            int64_t pair = t * k + j, row = pos[pair];
            float w = w_bf16 ? bf16_to_f32(((const uint16_t*)weights)[pair])
                             : ((const float*)weights)[pair];
            __m256 y = bf ? load_bf16((const uint16_t*)ys + row * H + h)
                          : load_f32((const float*)ys + row * H + h);
            __m256 prod = _mm256_mul_ps(y, _mm256_set1_ps(w));
            __asm__("" : "+x"(prod)); /* not contracted into the add */
            acc = _mm256_add_ps(acc, prod);
        }
        if (bf) {
            __m256i r = _mm256_srli_epi32(bias8_bf16(acc), 16);
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                              _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i*)((uint16_t*)out + t * H + h), packed);
        } else {
            _mm256_storeu_ps((float*)out + t * H + h, acc);
        }
    }
}

/* The experts' SwiGLU MLPs for T tokens with k slots each, and their router-weighted sum -> out
   [T, H] in the activations' dtype (bf16 where bf, else fp32; x [T, H] too). w13 [E, 2I, H],
   w2 [E, H, I], bf16; ids [T * k]: each (token, slot) pair's expert; weights [T * k]: fp32, or
   bf16 where w_bf16. H % 16 == 0, I % 16 == 0. Returns -1, or the first pair whose expert is
   not in [0, E) (nothing computed then). */
int64_t moe_decode_bf16(const void* x, int bf, const uint16_t* w13, const uint16_t* w2,
                        int64_t E, const int64_t* ids, const void* weights, int w_bf16,
                        void* out, int64_t T, int64_t k, int64_t H, int64_t I) {
    int64_t R = T * k, size = bf ? 2 : 4, bad = bad_id(ids, R, E);
    if (bad >= 0) return bad;
    Groups g = groups_of(ids, R, E);
    float* xs = malloc(sizeof(float) * R * (H + I)); /* split rows: x's, then the SiLU's */
    float* hs = xs + R * H;
    Hidden b = hidden_alloc(R, H, I, size);
    char *h13 = b.h13, *h = b.h, *ys = b.ys;
    Pass up = {w13, 2 * I, H, (2 * I + 3) / 4, xs, h13};
    Pass down = {w2, H, I, (H + 3) / 4, hs, ys};
    Share up_shares[SHARE_MAX] __attribute__((aligned(64)));
    Share down_shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(up_shares, parts, g.n * up.blocks);
    shares_init(down_shares, parts, g.n * down.blocks);
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) /* sorted row r: token order[r] / k */
            gemv_bf16_split_x((const char*)x + g.order[r] / k * H * size, bf, xs + r * H, 1, H);
        run_pass(&up, &g, up_shares, parts, bf);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            void* hr = h + r * I * size;
            if (bf) silu_mul_bf16((const uint16_t*)(h13 + r * 2 * I * size), hr, 1, I);
            else silu_mul_f32((const float*)(h13 + r * 2 * I * size), hr, 1, I);
            gemv_bf16_split_x(hr, bf, hs + r * I, 1, I);
        }
        run_pass(&down, &g, down_shares, parts, bf);
        #pragma omp barrier
        weigh_and_sum(ys, g.pos, weights, w_bf16, out, T, k, H, bf);
    }
    release(&b, xs, &g);
    return -1;
}

/* Quantized experts (qgemv.c's row-major layout, or qvpanel.c's panels): each expert's
   operands and the kernel the per-expert loop runs for each row count (qgemv's arguments:
   qgemv, qvpanel, the AMX kernels...), as int64 words: codes, codes per expert (bytes), code
   row stride (bytes), scales, scales per expert (bytes), zero points (0: none), zero points per
   expert (bytes), group row stride (elements), N, K, group size, group mins (0: none; GGUF's
   K-quants), mins per expert (bytes), their row stride (elements), the compact mins' dmin
   (0: fp32 mins; else the mins are u8 m: common.h's Mins), dmin per expert (bytes), its row
   stride (elements), groups per dmin, then the kernel for M = 1, 2, ... rows (as many as the
   caller lets an expert have). */
typedef void (*QMatmulFn)(const void*, int, const void*, int64_t, const void*, const void*,
                          int64_t, void*, int, int64_t, int64_t, int64_t, int64_t);
enum { Q_CODES, Q_CODES_E, Q_CSTRIDE, Q_SCALES, Q_SCALES_E, Q_ZEROS, Q_ZEROS_E, Q_GSTRIDE, Q_N,
       Q_K, Q_GS, Q_MINS, Q_MINS_E, Q_MSTRIDE, Q_MSCALE, Q_MSCALE_E, Q_SSTRIDE, Q_PER,
       Q_KERNELS };

static inline const char* at_expert(int64_t base, int64_t per_expert, int64_t e) {
    return base ? (const char*)(intptr_t)base + e * per_expert : 0;
}

/* q's expert e against x [M, q[Q_K]] -> y [M, q[Q_N]], in the activations' dtype: 1. With
   group mins, the kernel into fp32 and qmins.c's term into y (matmul.minus_mins' calls): 0
   where there was no memory for either. */
static int q_expert(const int64_t* q, int64_t e, const void* x, int bf, void* y, int64_t M) {
    const void* mins = at_expert(q[Q_MINS], q[Q_MINS_E], e);
    const float* mscale = (const float*)at_expert(q[Q_MSCALE], q[Q_MSCALE_E], e);
    float* acc = mins ? malloc(sizeof(float) * M * q[Q_N]) : 0;
    if (mins && !acc) return 0;
    ((QMatmulFn)(intptr_t)q[Q_KERNELS + M - 1])(
        x, bf, at_expert(q[Q_CODES], q[Q_CODES_E], e), q[Q_CSTRIDE],
        at_expert(q[Q_SCALES], q[Q_SCALES_E], e), at_expert(q[Q_ZEROS], q[Q_ZEROS_E], e),
        q[Q_GSTRIDE], mins ? (void*)acc : y, mins ? 0 : bf, M, q[Q_N], q[Q_K], q[Q_GS]);
    int ok = 1;
    if (mins) {
        ok = qmins(x, bf, acc, mins, q[Q_MSTRIDE], mscale, q[Q_SSTRIDE], q[Q_PER], y, bf, M,
                   q[Q_N], q[Q_K], q[Q_GS]);
        free(acc);
    }
    return ok;
}

/* Float experts through the GEMV the per-expert loop picks for each row count (cpu_linear's
   row_runner): words: weights, bytes per expert, N, K, then per row count M = 1..F_ROWS the
   kernel and its form (1: gemv_bf16's eight arguments, the last x's dtype; 0: gemv512_* and
   gemv_f32's seven; 2: amx_bf16's seven, 0 returned where it computed nothing). */
typedef void (*Matmul8Fn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int, int);
typedef void (*Matmul7Fn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int);
typedef int (*MatmulIntFn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int);
enum { F_W, F_W_E, F_N, F_K, F_KERNELS };
#define F_ROWS 16

/* f's expert e against x [M, f[F_K]] -> y [M, f[F_N]], by f's kernel for M rows: 1, or 0
   where the kernel computed nothing. */
static int f_expert(const int64_t* f, int64_t e, const void* x, int bf, void* y, int64_t M) {
    const int64_t* kernel = f + F_KERNELS + 2 * (M - 1);
    const void* w = (const char*)(intptr_t)f[F_W] + e * f[F_W_E];
    if (kernel[1] == 2)
        return ((MatmulIntFn)(intptr_t)kernel[0])(x, w, y, M, f[F_N], f[F_K], bf);
    if (kernel[1])
        ((Matmul8Fn)(intptr_t)kernel[0])(x, w, y, M, f[F_N], f[F_K], bf, bf);
    else
        ((Matmul7Fn)(intptr_t)kernel[0])(x, w, y, M, f[F_N], f[F_K], bf);
    return 1;
}

typedef int (*ExpertFn)(const int64_t*, int64_t, const void*, int, void*, int64_t);

/* The experts' SwiGLU MLPs as moe_decode_bf16 computes them, each chosen expert's rows through
   `expert` (w13's words a13, w2's a2) as the per-expert loop calls its kernels (the same bits).
   The kernels run their own parallel regions; called from inside this one they run on the
   calling thread alone (a nested region of one), so the experts, not their blocks, are shared
   among the threads: one fork and join a layer instead of two per expert, without a change to
   the kernels. -1 (done), the first out-of-range id's index, or -2 where an expert's kernel
   computed nothing (amx_bf16 without memory for its packed x). */
static int64_t moe_decode_each(ExpertFn expert, const void* x, int bf, const int64_t* a13,
                               const int64_t* a2, int64_t E, const int64_t* ids,
                               const void* weights, int w_bf16, void* out, int64_t T, int64_t k,
                               int64_t H, int64_t I) {
    int64_t R = T * k, size = bf ? 2 : 4, bad = bad_id(ids, R, E);
    if (bad >= 0) return bad;
    Groups g = groups_of(ids, R, E);
    char* xs = malloc(size * R * H); /* x's rows in expert order */
    Hidden b = hidden_alloc(R, H, I, size);
    char *h13 = b.h13, *h = b.h, *ys = b.ys;
    int failed = 0;
    #pragma omp parallel
    {
        omp_set_num_threads(1); /* this thread's nested regions: the kernels' blocks in order */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t grp = 0; grp < g.n; grp++) {
            int64_t r0 = g.start[grp], M = g.count[grp], e = g.expert[grp];
            for (int64_t r = r0; r < r0 + M; r++)
                memcpy(xs + r * H * size, (const char*)x + g.order[r] / k * H * size, H * size);
            int ok = expert(a13, e, xs + r0 * H * size, bf, h13 + r0 * 2 * I * size, M);
            if (bf) silu_mul_bf16((const uint16_t*)(h13 + r0 * 2 * I * size),
                                  (uint16_t*)(h + r0 * I * size), M, I);
            else silu_mul_f32((const float*)(h13 + r0 * 2 * I * size),
                              (float*)(h + r0 * I * size), M, I);
            ok &= expert(a2, e, h + r0 * I * size, bf, ys + r0 * H * size, M);
            if (!ok) {
                #pragma omp atomic write
                failed = 1;
            }
        }
        weigh_and_sum(ys, g.pos, weights, w_bf16, out, T, k, H, bf);
    }
    release(&b, xs, &g);
    return failed ? -2 : -1;
}

/* moe_decode_bf16 for quantized experts q13 (N = 2I, K = H) and q2 (N = H, K = I). */
int64_t moe_decode_q(const void* x, int bf, const int64_t* q13, const int64_t* q2, int64_t E,
                     const int64_t* ids, const void* weights, int w_bf16, void* out, int64_t T,
                     int64_t k, int64_t H, int64_t I) {
    return moe_decode_each(q_expert, x, bf, q13, q2, E, ids, weights, w_bf16, out, T, k, H, I);
}

/* moe_decode_bf16 for float experts whose GEMV picks are not gemv_bf16's at every row count
   (gemv512 on AVX-512), as f13 and f2's words say (T <= F_ROWS). */
int64_t moe_decode_f(const void* x, int bf, const int64_t* f13, const int64_t* f2, int64_t E,
                     const int64_t* ids, const void* weights, int w_bf16, void* out, int64_t T,
                     int64_t k, int64_t H, int64_t I) {
    return moe_decode_each(f_expert, x, bf, f13, f2, E, ids, weights, w_bf16, out, T, k, H, I);
}

/* The router's choice for T tokens (moe.route on the CPU at decode, and the decode chain's): per
   token, the softmax of its logits [E] (bf16 where logits_bf16, else fp32) in fp32, the k
   largest probabilities in descending order, ties to the lower expert id, divided by their
   sum where renorm -> weights [T, k] (bf16 where w_bf16, rounded to the nearest, ties to
   even, else fp32) and ids [T, k]. k <= E. */
void moe_route(const void* logits, int logits_bf16, int64_t T, int64_t E, int64_t k,
               int renorm, void* weights, int w_bf16, int64_t* ids) {
    float* p = malloc(sizeof(float) * E);
    float* chosen = malloc(sizeof(float) * k);
    char* taken = malloc(E);
    for (int64_t t = 0; t < T; t++) {
        float top = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = logits_bf16 ? bf16_to_f32(((const uint16_t*)logits)[t * E + e])
                               : ((const float*)logits)[t * E + e];
            top = p[e] > top ? p[e] : top;
        }
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - top);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        /* k passes of a selection: the largest not yet taken, the lowest id among equals (the
           first found stays), NaN above everything (as torch's descending sort puts it). */
        memset(taken, 0, E);
        float total = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                if (taken[e]) continue;
                if (best < 0 || (isnan(p[e]) ? !isnan(p[best]) : p[e] > p[best])) best = e;
            }
            taken[best] = 1;
            ids[t * k + j] = best;
            total += chosen[j] = p[best];
        }
        for (int64_t j = 0; j < k; j++) {
            float w = renorm ? chosen[j] / total : chosen[j];
            if (w_bf16) ((uint16_t*)weights)[t * k + j] = f32_to_bf16(w);
            else ((float*)weights)[t * k + j] = w;
        }
    }
    free(taken);
    free(chosen);
    free(p);
}
