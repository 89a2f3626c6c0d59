/* A decode step's decoder layers as one call: a list of kernel calls, built once per batch size
   with every argument bound (weights, kernel picks, the step's own buffers; cpu_chain.py), run
   in order. From Python each of the ~10 calls a layer costs a few microseconds of ctypes
   conversion, tensor allocation and interpreter time, ~1/5 of a B=1 step on a 2-core Zen 3;
   here it is a load and an indirect call. The kernels are the ones the unfused path calls, on
   the same arguments, so the results are the same bits.

   An op is OP_WORDS int64 words: its kind, the kernel's address, then the kernel's arguments in
   its own order (a float as the bits of a double). What changes from step to step (the
   embedding rows or the token ids to look them up by, the step's KV slots and positions,
   the logits' buffer) is read from `step` (STEP_*). */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "panel.h"

#define OP_WORDS 24

enum { OP_NORM = 0, OP_ATTN = 1, OP_SILU = 2, OP_MM8 = 3, OP_MM7 = 4, OP_QMM = 5, OP_ROWS = 6,
       OP_ROPE = 7, OP_ROUTE = 8, OP_MOE = 9, OP_PROWS = 10, OP_MMI = 11, OP_MINS = 12 };
/* Indices into the per-step values. */
enum { STEP_X = 0, STEP_SLOTS = 1, STEP_LENS = 2, STEP_KMAX = 3, STEP_NEW_SLOTS = 4,
       STEP_COS = 5, STEP_SIN = 6, STEP_OUT = 7, STEP_IDS = 8, STEP_POS = 9 };
/* Argument words that stand for the step's input rows (the first layer's input, and its
   residual) and for the step's own output buffer (the LM head's logits: a new tensor each
   step, as the layer-by-layer path returns, not a buffer the next step rewrites). */
#define FROM_STEP_X (-1)
#define FROM_STEP_OUT (-2)

typedef void (*NormFn)(const void*, int64_t, int64_t, const void*, void*, const void*, int64_t,
                       void*, int64_t, int64_t, float, const void*, const void*);
typedef void (*AttnFn)(const void*, int64_t, int, void*, void*, const int64_t*, const int64_t*,
                       int64_t, void*, int, int64_t, int64_t, int64_t, int64_t, float,
                       const void*, int64_t, const void*, int64_t, const int64_t*);
typedef void (*SiluFn)(const void*, void*, int64_t, int64_t);
/* gemv_bf16, panel_bf16: (x, w, y, M, N, K, out_bf16, x_bf16) */
typedef void (*Matmul8Fn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int, int);
/* gemv_f32, gemv512_*: (x, w, y, M, N, K, out_bf16) */
typedef void (*Matmul7Fn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int);
/* amx_bf16: the same arguments, 0 where it computed nothing (no memory for its packed x) */
typedef int (*MatmulIntFn)(const void*, const void*, void*, int64_t, int64_t, int64_t, int);
/* qgemv_* and the kernels that take its arguments */
typedef void (*QMatmulFn)(const void*, int, const void*, int64_t, const void*, const void*,
                          int64_t, void*, int, int64_t, int64_t, int64_t, int64_t);
/* qmins: (x, x_bf16, fp32 product, mins, group stride, dmin, its stride, groups per dmin, y,
   out_bf16, M, N, K, group size) */
typedef int (*MinsFn)(const void*, int, const float*, const void*, int64_t, const float*,
                      int64_t, int64_t, void*, int, int64_t, int64_t, int64_t, int64_t);
/* moe_route: (logits, logits_bf16, T, E, k, renorm, weights, weights_bf16, ids) */
typedef void (*RouteFn)(const void*, int, int64_t, int64_t, int64_t, int, void*, int, int64_t*);
/* moe_decode_bf16, moe_decode_q, moe_decode_f: (x, x_bf16, w13, w2, E, ids, weights,
   weights_bf16, out, T, k, H, I) */
typedef int64_t (*MoeFn)(const void*, int, const void*, const void*, int64_t, const int64_t*,
                         const void*, int, void*, int64_t, int64_t, int64_t, int64_t);
/* qdequant_*: (codes, code stride, scales, zeros, group stride, out fp32, r0, r1, K, group) */
typedef void (*DequantFn)(const void*, int64_t, const void*, const void*, int64_t, float*,
                          int64_t, int64_t, int64_t, int64_t);

static inline void* ptr(int64_t v) { return (void*)(intptr_t)v; }
static inline float as_float(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}
static inline void* input(int64_t v, const int64_t* step) {
    return ptr(v == FROM_STEP_X ? step[STEP_X] : v == FROM_STEP_OUT ? step[STEP_OUT] : v);
}

/* a: x, x_group, x_stride, res_in, res_out, w, w_rows, out, M, D, eps, rope (0/1). */
static void run_norm(const int64_t* a, void* fn, const int64_t* step) {
    const void* cos = a[11] ? ptr(step[STEP_COS]) : 0;
    const void* sin = a[11] ? ptr(step[STEP_SIN]) : 0;
    ((NormFn)fn)(input(a[0], step), a[1], a[2], input(a[3], step), ptr(a[4]), ptr(a[5]), a[6],
                 ptr(a[7]), a[8], a[9], as_float(a[10]), cos, sin);
}

/* a: q, q_stride, q_bf16, k_pool, v_pool, out, out_bf16, B, Hq, Hkv, D, scale, k_new, k_stride,
   v_new, v_stride; the slots, lengths and new rows' slots are the step's. */
static void run_attn(const int64_t* a, void* fn, const int64_t* step) {
    ((AttnFn)fn)(ptr(a[0]), a[1], (int)a[2], ptr(a[3]), ptr(a[4]), ptr(step[STEP_SLOTS]),
                 ptr(step[STEP_LENS]), step[STEP_KMAX], ptr(a[5]), (int)a[6], a[7], a[8], a[9],
                 a[10], as_float(a[11]), ptr(a[12]), a[13], ptr(a[14]), a[15],
                 ptr(step[STEP_NEW_SLOTS]));
}

/* fp32 to bf16 rounded to nearest even, as torch's .to(torch.bfloat16) (NaN as its scalar
   conversion's 0x7FC0; a dequantized row has none). */
static void to_bf16(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        y[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0
                                               : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
    }
}

/* The step's token ids' rows of a quantized embedding table (a tied LM head's), as
   QuantWeight.rows looks up a decode step's few: each row by the dequantizer into fp32, then
   to the model's dtype. a: codes, code stride, scales, zeros, group stride, out, rows, K,
   group, out_bf16, a K-float scratch row (out_bf16). */
static void run_rows(const int64_t* a, void* fn, const int64_t* step) {
    const int64_t* ids = ptr(step[STEP_IDS]);
    const int64_t k = a[7];
    for (int64_t r = 0; r < a[6]; r++) {
        float* row = a[9] ? (float*)ptr(a[10]) : (float*)ptr(a[5]) + r * k;
        ((DequantFn)fn)(ptr(a[0]), a[1], ptr(a[2]), ptr(a[3]), a[4], row, ids[r], ids[r] + 1, k,
                        a[8]);
        if (a[9]) to_bf16(row, (uint16_t*)ptr(a[5]) + r * k, k);
    }
}

/* The step's token ids' rows of a bf16 table kept only as its tied LM head's panels
   (VocabParallelEmbedding.use_panels), copied out as cpu_kernels.panel_rows reads them:
   panels [n / width][K][width], on AVX512-BF16 builds K in pairs ([K / 2][width][2]), else
   the lanes interleaved (panel_pack_bf16's order). a: panels, K, width, pairs, out, rows. */
static void run_panel_rows(const int64_t* a, const int64_t* step) {
    const uint16_t* data = ptr(a[0]);
    const int64_t k = a[1], width = a[2];
    const int64_t* ids = ptr(step[STEP_IDS]);
    for (int64_t r = 0; r < a[5]; r++) {
        const int64_t col = ids[r] % width;
        const uint16_t* panel = data + (ids[r] / width) * k * width;
        uint16_t* row = (uint16_t*)ptr(a[4]) + r * k;
        if (a[3]) { /* a pair of K at a time: 4 bytes */
            for (int64_t j = 0; j < k / 2; j++)
                memcpy(row + 2 * j, panel + (j * width + col) * 2, 4);
        } else {
            const int64_t lane = panel16_lane(col);
            for (int64_t i = 0; i < k; i++) row[i] = panel[i * width + lane];
        }
    }
}

static inline void run_op(const int64_t* op, const int64_t* step) {
    void* fn = ptr(op[1]);
    const int64_t* a = op + 2;
    switch (op[0]) {
        case OP_NORM: run_norm(a, fn, step); break;
        case OP_ATTN: run_attn(a, fn, step); break;
        case OP_SILU: ((SiluFn)fn)(ptr(a[0]), ptr(a[1]), a[2], a[3]); break;
        case OP_MM8:
            ((Matmul8Fn)fn)(input(a[0], step), ptr(a[1]), input(a[2], step), a[3], a[4], a[5],
                            (int)a[6], (int)a[7]);
            break;
        case OP_MM7:
            ((Matmul7Fn)fn)(input(a[0], step), ptr(a[1]), input(a[2], step), a[3], a[4], a[5],
                            (int)a[6]);
            break;
        case OP_QMM:
            ((QMatmulFn)fn)(input(a[0], step), (int)a[1], ptr(a[2]), a[3], ptr(a[4]), ptr(a[5]),
                            a[6], input(a[7], step), (int)a[8], a[9], a[10], a[11], a[12]);
            break;
        case OP_ROWS: run_rows(a, fn, step); break;
        case OP_PROWS: run_panel_rows(a, step); break;
        case OP_ROUTE:
            ((RouteFn)fn)(ptr(a[0]), (int)a[1], a[2], a[3], a[4], (int)a[5], ptr(a[6]), (int)a[7],
                          ptr(a[8]));
            break;
    }
}

/* The step's rotary rows: cos and signed sin of each row's position (step[STEP_POS], int64),
   from the fp32 tables [positions, D] into the buffers the q/k norms' rotation reads
   (step[STEP_COS], step[STEP_SIN]), in the model's dtype: RotaryEmbedding.cos_sin's gather
   and .to(dtype), bit for bit, without its four torch calls a step. a: cos table, sin table,
   table rows, D, rows, out_bf16. 0, or -1 (nothing written) where a position is past the
   tables. */
static int64_t run_rope(const int64_t* a, const int64_t* step) {
    const int64_t* pos = ptr(step[STEP_POS]);
    const int64_t d = a[3];
    for (int64_t r = 0; r < a[4]; r++)
        if (pos[r] < 0 || pos[r] >= a[2]) return -1;
    for (int t = 0; t < 2; t++) {
        const float* table = ptr(a[t]);
        void* out = ptr(step[t ? STEP_SIN : STEP_COS]);
        for (int64_t r = 0; r < a[4]; r++) {
            if (a[5])
                to_bf16(table + pos[r] * d, (uint16_t*)out + r * d, d);
            else
                memcpy((float*)out + r * d, table + pos[r] * d, sizeof(float) * d);
        }
    }
    return 0;
}

/* OP_MMI: a matmul that may compute nothing (amx_bf16): 0, or -2 where it did. */
static int64_t run_mmi(const int64_t* op, const int64_t* step) {
    const int64_t* a = op + 2;
    return ((MatmulIntFn)ptr(op[1]))(input(a[0], step), ptr(a[1]), input(a[2], step), a[3], a[4],
                                      a[5], (int)a[6])
               ? 0
               : -2;
}

/* OP_MOE: 0, or -2 where an expert's matmul computed nothing (the ids are the route op's,
   every one an expert: nothing else to refuse). */
static int64_t run_moe(const int64_t* op, const int64_t* step) {
    const int64_t* a = op + 2;
    int64_t got = ((MoeFn)ptr(op[1]))(input(a[0], step), (int)a[1], ptr(a[2]), ptr(a[3]), a[4],
                                      ptr(a[5]), ptr(a[6]), (int)a[7], input(a[8], step), a[9],
                                      a[10], a[11], a[12]);
    return got == -2 ? -2 : 0;
}

/* OP_MINS (qmins.c): 0, or -2 where it computed nothing (no memory for x's sums). */
static int64_t run_mins(const int64_t* op, const int64_t* step) {
    const int64_t* a = op + 2;
    return ((MinsFn)ptr(op[1]))(input(a[0], step), (int)a[1], ptr(a[2]), ptr(a[3]), a[4],
                                ptr(a[5]), a[6], a[7], input(a[8], step), (int)a[9], a[10],
                                a[11], a[12], a[13])
               ? 0
               : -2;
}

/* One op of the chain: 0, -1 where it refused the step (run_rope), -2 where a matmul
   failed (run_mmi, run_moe, run_mins). */
static int64_t run_any(const int64_t* op, const int64_t* step) {
    if (op[0] == OP_ROPE) return run_rope(op + 2, step);
    if (op[0] == OP_MMI) return run_mmi(op, step);
    if (op[0] == OP_MOE) return run_moe(op, step);
    if (op[0] == OP_MINS) return run_mins(op, step);
    run_op(op, step);
    return 0;
}

/* 0; -1 where an op refused the step before any layer ran (the rotary rows' positions
   past the tables: the caller runs the step its other way, which reports it); -2 where a
   matmul failed part-way (the layers' buffers and the KV rows written so far are not the
   step's: the caller raises). */
int64_t decode_chain(const int64_t* ops, int64_t n_ops, const int64_t* step) {
    for (int64_t i = 0; i < n_ops; i++) {
        int64_t refused = run_any(ops + i * OP_WORDS, step);
        if (refused) return refused;
    }
    return 0;
}

/* decode_chain with each op's time added to ns[i], in nanoseconds of `clock_id` (0: wall,
   CLOCK_MONOTONIC; 1: the process's CPU time): where a step's time goes (the benchmarks'
   breakdown), at the cost of a clock read per op. */
int64_t decode_chain_timed(const int64_t* ops, int64_t n_ops, const int64_t* step, int64_t* ns,
                           int clock_id) {
    clockid_t clk = clock_id ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC;
    struct timespec t0, t1;
    clock_gettime(clk, &t0);
    for (int64_t i = 0; i < n_ops; i++) {
        int64_t refused = run_any(ops + i * OP_WORDS, step);
        if (refused) return refused;
        clock_gettime(clk, &t1);
        ns[i] += (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        t0 = t1;
    }
    return 0;
}
