/* Integer codes (8-bit, 4-bit in groups) repacked once at load into panels of 32 weight rows,
   multiplied exactly by x quantized per row to int16, for any number of rows, with
   AVX512-VNNI's VPDPWSSD (one row of 4-bit codes: VPDPBUSD, see vp_split); fp8 e4m3 codes in
   panels of their own against bf16 x (VDPBF16PS, at the end of the file). minisgl/quant/
   cpu_vpanel.py's vnni_panel.

   Why a layout of its own: the row-major codes' kernels (qgemv.c) sum along K in each lane and
   reduce a row across lanes at the end, loading x's vectors again for every weight row; with
   lanes along the outputs instead, a 64-byte load holds 16 rows' codes for the same 4 (8-bit)
   or 8 (4-bit) features, each row of x meets it with one broadcast dword per VPDPWSSD, and a
   thread reads one contiguous run of memory per panel. On an AMD EPYC Zen 4 (avx512f/bw/vl,
   avx512_vnni, no AMX; 2 threads, cold weights, best of 7, against the row-major pick in the
   same run; docs/performance.md): 6144x1024 one row 1.25x (8-bit) and 1.15x (4-bit, group
   128), 8 rows 1.09x and 1.78x, 64 rows 1.28x and 1.19x, 512 rows 1.08x and 1.03x.

   Layout (cpu_vpanel.pack): codes [N/32][K/4][32] dwords for 8-bit codes, each the 4 codes of
   features 4q..4q+3 of one row (the row-major bytes as they are), [N/32][K/8][32] for 4-bit
   codes, each 8 codes (features 8q..8q+7, 2j in a byte's low nibble, as loaded); scales
   [N/32][G][32] floats, zero points [N/32][G][32] bytes: a panel is two zmm of outputs. A
   16-bit lane pair of a dword gives two codes as int16 with one mask (and a shift): 8-bit
   (c0, c2) and (c1, c3), 4-bit (n_j, n_{j+4}) for j = 0..3, and x is laid out per row in the
   same pairs.

   Numerics: x quantized per row (max|x| / 32767, nearest even, as qgemv.c), integer sums
   exact within a chunk of L features (L divides the group; a lane's sum and its zero-point
   term stay within int32: 8-bit L <= 256, 4-bit L <= 2048), the zero point subtracted in
   int32 (exact: the true difference fits, the products wrap alike), then one conversion to
   fp32 and a multiply-add by the group's scale per chunk; the row's scale last. A row's
   result does not depend on the rows beside it, the tile it falls in or the thread count.
   Under --cpu-quantized-activations int8 the same panels meet x in 8 bits (vp_quantize_row8,
   vp_tile's x8 form). */
#include <string.h>

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

/* GCC 12's partial redundancy elimination kept the tiles' sums in stack slots as well as in
   registers, a store and a copy for every product instruction (8-bit codes at 8 rows: 90
   instructions for 32 VPDPWSSD instead of 56); with it off, and vp_tile's loops over the sums
   unrolled (an array indexed in a loop stays in memory), none is left. 1 thread, Zen 4, 8-bit
   codes at 8-256 rows: 77-85 -> 93-110 G products a second (VPDPWSSD's peak ~110); with x in 8
   bits 93-164 -> 178-194. */
#pragma GCC optimize("no-tree-pre")

#define VP_ROWS 32  /* weight rows per panel: two zmm of int32 lanes */
#define VP_TILE 8   /* rows of x per register tile */
/* Tiles of this many rows and more prefetch the panel's lines 4 KB ahead: their products
   keep the core busy long enough that the hardware's prefetch alone falls behind (2 threads,
   Zen 4, cold weights, 8 rows 1.03-1.19x, 16 rows 1.03-1.10x, 64 rows 1.01-1.03x); one row
   streamed at the memory's rate without it and lost with it (0.64-1.10x; but see
   vp_row_prefetch). */
#define VP_PF_ROWS 4
#define VP_PF_BYTES 4096
/* Whether one row prefetches the panels' lines VP_PF_BYTES ahead into L2: set per process by
   cpu_vpanel.py, which measures it. It pays on some CPUs and not on others: on the Xeon
   (Sapphire Rapids class, KVM, 2 threads, cold panels) 8-bit 17.8-20.5 -> 23.0-25.8 GB/s,
   4-bit 17.0-19.5 -> 21.6-27.6 (into L1: 19.1-24.4), where into L1 on the Zen 4 it lost.
   Tiles of 2 and 3 rows follow it (they had no prefetch: on the Xeon without AVX512-BF16,
   6144x1024 cold, 2 threads, 2 rows 8-bit 14.4 -> 19.5 GB/s, 4-bit 12.4 -> 18.2; with x in 8
   bits 19.5 -> 23.9, 16.8 -> 22.3; one row 22.1-24.3; Qwen3-0.6B decode steps at B=2 and 3,
   in turns: 8-bit 1.11-1.36x, 4-bit 1.17-1.56x as fast). */
int vp_row_prefetch = 0;
/* With it, 8-bit codes' lines also go to L1 this far ahead: 1.02-1.03x on the same Xeon (one
   row, 2 threads, cold: 151936x1024 28.7 -> 29.7 GB/s, 6144x1024 25.6 -> 26.2; 256 and 512
   bytes ahead in between); 4-bit codes gained nothing from it. */
#define VP_ROW_NEAR 1024

/* A tile of R rows reaching a panel line: the line VP_PF_BYTES ahead into L1 from VP_PF_ROWS
   rows, else into L2 where row_pf (vp_row_prefetch, read once per tile). */
static inline __attribute__((always_inline)) void vp_prefetch(const void* line, const int R,
                                                              int row_pf) {
    if (R >= VP_PF_ROWS) _mm_prefetch((const char*)line + VP_PF_BYTES, _MM_HINT_T0);
    else if (row_pf) _mm_prefetch((const char*)line + VP_PF_BYTES, _MM_HINT_T1);
}

/* Whether vnni_panel takes codes of `bits` bits in groups of gs features, N x K: groups of a
   multiple of 32, or 8-bit codes in groups of 16 (GGUF's Q6_K: a chunk of 16 features, x
   still quantized 32 features at a time, K % 32 == 0). */
int qvpanel_takes(int bits, int64_t N, int64_t K, int64_t gs) {
    const int groups = gs > 0 && (gs % 32 == 0 || (bits == 8 && gs == 16 && K % 32 == 0));
    return (bits == 4 || bits == 8) && N % VP_ROWS == 0 && groups && K % gs == 0;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Features per exact chunk: the largest divisor of the group within the int32 bound. */
static int64_t chunk_len(int bits, int64_t gs) { return gcd64(gs, bits == 8 ? 256 : 2048); }

/* Whether a tile of R rows of x meets 4-bit codes as VPDPBUSD's bytes, x's int16 split into a
   signed high byte and an unsigned low one (two products per code, as the int16 pairs take,
   but the codes need one mask and shift where the pairs take three more to widen them): one
   row only, where the widening bounds the loop (4096x1024 in groups of 128, 2 threads, codes
   in cache: 1.22x; 2 rows: 1.00x, the products bound them). The same integer sums, so the
   same bits. */
static inline int vp_split(int bits, int64_t R) { return bits == 4 && R == 1; }

/* 32 int16 of x in feature order -> 16 dwords, per 8 features: the high bytes of the even
   features (x0 x2 x4 x6, arithmetic shift: signed), their low bytes (unsigned), then the same
   two for the odd ones; x = 256 * high + low exactly. */
static inline void vp_split_bytes(__m512i v, int32_t* d) {
    const __m256i odd_even = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13,
                                              15, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11,
                                              13, 15);
    __m256i lo = _mm256_shuffle_epi8(_mm512_cvtepi16_epi8(v), odd_even);
    __m256i hi = _mm256_shuffle_epi8(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)), odd_even);
    __m256i u = _mm256_unpacklo_epi32(hi, lo), w = _mm256_unpackhi_epi32(hi, lo);
    _mm256_store_si256((__m256i*)d, _mm256_permute2x128_si256(u, w, 0x20));
    _mm256_store_si256((__m256i*)(d + 8), _mm256_permute2x128_si256(u, w, 0x31));
}

/* Row m of x's scale for its int16 codes: max|x| / 32767 (1 where the row is 0 or not
   finite). */
static float vp_row_scale(const void* x, int x_bf16, int64_t m, int64_t K) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        mx = _mm512_max_ps(mx, _mm512_and_ps(load16_x(x, x_bf16, m * K + k), abs_mask));
    float amax = _mm512_reduce_max_ps(mx);
    return amax > 0 && isfinite(amax) ? amax / 32767.0f : 1.0f;
}

/* 16 values of x from `at` times the inverse scale, to int16 codes (nearest even, clamped to
   +-32767) in int32 lanes. */
static inline __m512i vp_q16(const void* x, int x_bf16, int64_t at, __m512 inv) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16_x(x, x_bf16, at), inv));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)),
                            _mm512_set1_epi32(-32767));
}

/* Row m of x -> int16 codes in the panel's pair order, written as dwords into its tile's
   interleaved layout (dword d of the tile's row r at xt[d * R + r] for a tile of R rows, so
   a step's broadcasts for a tile's rows sit at constant offsets from one pointer), the
   chunks' code sums (xsum), and the row's scale (returned). Pair order: 8-bit per 4 features
   x0 x2 x1 x3; 4-bit per 8 features x0 x4 x1 x5 x2 x6 x3 x7. */
static float vp_quantize_row(const void* x, int x_bf16, int64_t m, int64_t M, int64_t K,
                             int bits, int64_t L, int32_t* xt, int32_t* xsum) {
    const int64_t m0 = m - m % VP_TILE, R = M - m0 < VP_TILE ? M - m0 : VP_TILE;
    const int split = vp_split(bits, R);
    float s = vp_row_scale(x, x_bf16, m, K);
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    /* 32 features in order -> pair order, per quad (8-bit) or per 8 (4-bit) */
    const __m512i order8 = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19,
                                            17, 18, 16, 15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6,
                                            4, 3, 1, 2, 0);
    const __m512i order4 = _mm512_set_epi16(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21,
                                            17, 20, 16, 15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6,
                                            2, 5, 1, 4, 0);
    const __m512i order = bits == 8 ? order8 : order4;
    int32_t* row = xt + m0 * K / 2 + (m - m0);
    const int halves = L == 16; /* chunks of 16: two a step of 32, a sum each */
    for (int64_t c0 = 0; c0 < K; c0 += halves ? 32 : L) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = c0; k < c0 + (halves ? 32 : L); k += 32) {
            __m512i a = vp_q16(x, x_bf16, m * K + k, inv);
            __m512i b = vp_q16(x, x_bf16, m * K + k + 16, inv);
            if (halves) {
                xsum[k / 16] = _mm512_reduce_add_epi32(a);
                xsum[k / 16 + 1] = _mm512_reduce_add_epi32(b);
            }
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(a, b));
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)),
                                              _mm512_cvtepi32_epi16(b), 1);
            int32_t d[16] __attribute__((aligned(64)));
            if (split)
                vp_split_bytes(both, d);
            else
                _mm512_store_si512(d, _mm512_permutexvar_epi16(order, both));
            for (int i = 0; i < 16; i++) row[(k / 2 + i) * R] = d[i];
        }
        if (!halves) xsum[c0 / L] = _mm512_reduce_add_epi32(sum);
    }
    return s;
}

static void vp_store(void* y, int out_bf16, int64_t at, __m512 v) {
    if (out_bf16)
        _mm256_storeu_si256((__m256i*)((uint16_t*)y + at), pack16_bf16(v));
    else
        _mm512_storeu_ps((float*)y + at, v);
}

/* --cpu-quantized-activations int8 (qgemv.c's qgemv_x8, set per step): x rounded to 8 bits
   per row and block of B8 = gcd(group, 128) features, each block with its own scale (max|x| /
   127, nearest even), as qvnni.c's x8_panel rounds it; then the codes are VPDPBUSD's unsigned
   bytes as they are (8-bit) or after one mask (4-bit: low nibbles, then high ones) against
   x's signed bytes, one instruction per 64 products where exact x takes two VPDPWSSD. */
extern int qgemv_x8;

/* Rows of x per register tile with x in 8 bits: 12 rows x 32 outputs keep 24 int32 sums in
   registers, each broadcast feeding two VPDPBUSD (1 thread, Zen 4: 178-194 G products a
   second at 8-256 rows, x8_panel 95-190). */
#define VP_TILE8 12

static int64_t x8_block(int64_t gs) { return gcd64(gs, 128); }

/* qvnni.c's x8_panel rounding of x to 8 bits, per block of features (nearest even, each block
   scaled by its max|x| / 127): vnni_panel's 8-bit form and its AMX form round x with it. */
float qv_quantize_block(const void* x, int x_bf16, int64_t at, int64_t B, int8_t* q,
                        int32_t* sum);

/* Row m of x -> int8 codes as dwords in its tile's interleaved layout (as vp_quantize_row:
   dword d of the tile's row r at xt[d * R + r]), per block its sum of codes and its scale.
   Byte order: 8-bit codes' features 4q..4q+3 in order; 4-bit per 8 features, x0 x2 x4 x6 then
   x1 x3 x5 x7 (the low nibbles' features, then the high ones'). */
static void vp_quantize_row8(const void* x, int x_bf16, int64_t m, int64_t M, int64_t K,
                             int bits, int64_t B8, int32_t* xt, int32_t* xsum, float* xscale) {
    const int64_t m0 = m - m % VP_TILE8, R = M - m0 < VP_TILE8 ? M - m0 : VP_TILE8;
    int32_t* row = xt + m0 * K / 4 + (m - m0);
    /* 16 codes in feature order -> per 8, the even features' bytes, then the odd ones' */
    const __m128i odd_even = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    int8_t q[128] __attribute__((aligned(16))); /* B8 = gcd(group, 128) */
    for (int64_t c0 = 0; c0 < K; c0 += B8) {
        xscale[c0 / B8] = qv_quantize_block(x, x_bf16, m * K + c0, B8, q, &xsum[c0 / B8]);
        for (int64_t k = 0; k < B8; k += 16) {
            __m128i b = _mm_load_si128((const __m128i*)(q + k));
            if (bits == 4) b = _mm_shuffle_epi8(b, odd_even);
            int32_t d[4];
            _mm_storeu_si128((__m128i*)d, b);
            for (int i = 0; i < 4; i++) row[((c0 + k) / 4 + i) * R] = d[i];
        }
    }
}

/* A 64-byte load of codes (16 rows' dwords) as the int16 pairs VPDPWSSD takes against exact
   x's pairs: 8-bit codes (c0, c2), (c1, c3); 4-bit (n_j, n_{j+4}) for j = 0..3. */
static inline __attribute__((always_inline)) void vp_pairs16(__m512i d, const int bits,
                                                             __m512i* v) {
    if (bits == 8) {
        v[0] = _mm512_and_si512(d, _mm512_set1_epi32(0x00FF00FF));
        v[1] = _mm512_srli_epi16(d, 8);
        return;
    }
    const __m512i m4 = _mm512_set1_epi32(0x000F000F);
    v[0] = _mm512_and_si512(d, m4);
    v[1] = _mm512_and_si512(_mm512_srli_epi16(d, 4), m4);
    v[2] = _mm512_and_si512(_mm512_srli_epi16(d, 8), m4);
    v[3] = _mm512_srli_epi16(d, 12);
}

/* One panel (two zmm of 16 outputs) against R rows of x (a tile): fp32 results in
   out[r][32]. Exact (x8 = 0): int16 x pairs against codes as int16 pairs, VPDPWSSD, or (sp)
   the codes' bytes against x's high and low bytes, two VPDPBUSD into two sums; x8: x's
   bytes against the codes as VPDPBUSD's unsigned bytes, each chunk's sum also times its x
   scale (xsc). Each broadcast of x serves both halves, as the bf16 panels' do (one broadcast
   per product instruction, 16-row panels, took 1.2-1.4x the time at 8 rows). */
static inline __attribute__((always_inline)) void vp_tile(const uint32_t* P, const float* S,
                                                           const uint8_t* Z, const int zu,
                                                           const int32_t* xt,
                                                           const int32_t* xs, const float* xsc,
                                                           int64_t K, int64_t gs, int64_t L,
                                                           const int bits, const int x8,
                                                           const int sp, const int R,
                                                           float* out) {
    /* code vectors per 64-byte load: exact 8-bit 2 int16 pairs, 4-bit 4; x8 8-bit 1 (the
       codes as they are), 4-bit 2 (low nibbles, high nibbles); split 4-bit 2, each met by
       two x dwords (high bytes, low bytes) */
    const int nv = sp ? 2 : (bits == 8 ? 2 : 4) / (x8 ? 2 : 1);
    const int xw = sp ? 4 : nv;                  /* x dwords per code dword */
    const int64_t fpl = bits == 8 ? 4 : 8;       /* features per code dword */
    /* accumulator pairs per row, for the products' latency (split: 2 pairs of each sum, which
       ran 1.1-1.15x as fast as 1 or 4) */
    const int A = sp ? 2 : R == 1 ? 4 : (R == 2 ? 2 : 1);
    const int64_t nch = K / L;
    const __m512i n4 = _mm512_set1_epi32(0x0F0F0F0F);
    const int row_pf = vp_row_prefetch; /* 1-3 rows: as one row */
    /* The fp32 sums live in `out` (L1) between chunks, registers going to the integer sums;
       but at 1-2 rows, where registers are left, in `f`: their store and reload each chunk
       were on the loop's path (1 row of 4-bit codes in groups of 32, 2 threads, Zen 4, with
       the zero-point skip below: 1.3x as fast from L3; from memory, which bounds it there,
       level). */
    const int fr = R <= 2;
    __m512 f[VP_TILE8][2]; /* rows 0 .. R - 1 where fr */
    for (int r = 0; r < R && fr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int r = 0; r < 2 * R && !fr; r++) _mm512_storeu_ps(out + 16 * r, _mm512_setzero_ps());
    for (int64_t c = 0; c < nch; c++) {
        /* R * A <= 12 sums per half; the loops over them unrolled (see the top) */
        __m512i acc[VP_TILE8][2], lo[2][2];
#pragma GCC unroll 12
        for (int i = 0; i < R * A; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        for (int i = 0; i < 2; i++) lo[i][0] = lo[i][1] = _mm512_setzero_si512();
        const int64_t q0 = c * L / fpl, q1 = q0 + L / fpl;
        const uint32_t* w = P + VP_ROWS * q0;
        /* steps per iteration: enough vectors to feed every accumulator once */
        const int steps = A > nv ? A / nv : 1;
        for (int64_t q = q0; q < q1; q += steps, w += VP_ROWS * steps) {
            for (int s = 0; s < steps; s++) {
                __m512i v[2][4];
                for (int h = 0; h < 2; h++) {
                    __m512i d = _mm512_loadu_si512(w + VP_ROWS * s + 16 * h);
                    vp_prefetch(w + VP_ROWS * s + 16 * h, R, row_pf);
                    if (R == 1 && bits == 8 && row_pf)
                        _mm_prefetch((const char*)(w + VP_ROWS * s + 16 * h) + VP_ROW_NEAR,
                                     _MM_HINT_T0);
                    if (x8 && bits == 8) {
                        v[h][0] = d;
                    } else if (x8 || sp) {
                        v[h][0] = _mm512_and_si512(d, n4);
                        v[h][1] = _mm512_and_si512(_mm512_srli_epi16(d, 4), n4);
                    } else {
                        vp_pairs16(d, bits, v[h]);
                    }
                }
                for (int r = 0; r < R && sp; r++) {
                    const int32_t* xp = xt + (q + s) * xw * R + r;
                    for (int j = 0; j < nv; j++) {
                        int a = (s * nv + j) % A;
                        __m512i bh = _mm512_set1_epi32(xp[2 * j * R]);
                        __m512i bl = _mm512_set1_epi32(xp[(2 * j + 1) * R]);
                        for (int h = 0; h < 2; h++) {
                            acc[a][h] = _mm512_dpbusd_epi32(acc[a][h], v[h][j], bh);
                            lo[a][h] = _mm512_dpbusd_epi32(lo[a][h], bl, v[h][j]);
                        }
                    }
                }
                for (int r = 0; r < R && !sp; r++) {
                    const int32_t* xp = xt + (q + s) * nv * R + r;
                    for (int j = 0; j < nv; j++) {
                        int a = (s * nv + j) % A;
                        __m512i b = _mm512_set1_epi32(xp[j * R]);
                        for (int h = 0; h < 2; h++)
                            acc[r * A + a][h] =
                                x8 ? _mm512_dpbusd_epi32(acc[r * A + a][h], v[h][j], b)
                                   : _mm512_dpwssd_epi32(acc[r * A + a][h], v[h][j], b);
                    }
                }
            }
        }
        const int64_t g = c * L / gs;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512 sc = _mm512_loadu_ps(S + VP_ROWS * g + 16 * h);
            const int64_t zat = VP_ROWS * g + 16 * h;
            const __m512i z = Z && zu < 0
                                  ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(Z + zat)))
                                  : _mm512_setzero_si512();
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) {
                __m512i t = acc[r * A][h];
                for (int a = 1; a < A; a++) t = _mm512_add_epi32(t, acc[r * A + a][h]);
                if (sp) { /* 256 * (codes . x's high bytes) + codes . low bytes */
                    t = _mm512_slli_epi32(t, 8);
                    for (int a = 0; a < A; a++) t = _mm512_add_epi32(t, lo[a][h]);
                }
                /* zero points all 0 or all one value (vp_zero_points): no VPMULLD per row
                   and chunk (8 rows of Q4_K's codes, from memory: 1.03-1.06x as fast); the
                   product's low 32 bits, as VPMULLD's */
                const int32_t xsum = xs[r * nch + c];
                const int32_t zx = (int32_t)((uint32_t)zu * (uint32_t)xsum);
                if (Z)
                    t = _mm512_sub_epi32(t, zu >= 0
                                                ? _mm512_set1_epi32(zx)
                                                : _mm512_mullo_epi32(z, _mm512_set1_epi32(xsum)));
                __m512 scale = x8 ? _mm512_mul_ps(sc, _mm512_set1_ps(xsc[r * nch + c])) : sc;
                __m512 sum = fr ? f[r][h] : _mm512_loadu_ps(out + 32 * r + 16 * h);
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, sum);
                if (fr) f[r][h] = sum;
                else _mm512_storeu_ps(out + 32 * r + 16 * h, sum);
            }
        }
    }
    for (int r = 0; r < R && fr; r++)
        for (int h = 0; h < 2; h++) _mm512_storeu_ps(out + 32 * r + 16 * h, f[r][h]);
}

#define VP_TILE_CASE(n)                                                                    \
    case n:                                                                                \
        if (x8 && bits == 8) vp_tile(P, S, Z, zu, xt, xs, xsc, K, gs, L, 8, 1, 0, n, out); \
        else if (x8) vp_tile(P, S, Z, zu, xt, xs, xsc, K, gs, L, 4, 1, 0, n, out);         \
        else if (n <= VP_TILE && bits == 8)                                                \
            vp_tile(P, S, Z, zu, xt, xs, xsc, K, gs, L, 8, 0, 0, n, out);                  \
        else if (n == 1 && vp_split(bits, 1)) /* n first: no split tile built for more */ \
            vp_tile(P, S, Z, zu, xt, xs, xsc, K, gs, L, 4, 0, 1, n, out);                  \
        else if (n <= VP_TILE)                                                             \
            vp_tile(P, S, Z, zu, xt, xs, xsc, K, gs, L, 4, 0, 0, n, out);                  \
        break;

/* vp_tile for a tile of R rows (R <= VP_TILE exact, <= VP_TILE8 with x in 8 bits). */
static void vp_tile_any(const uint32_t* P, const float* S, const uint8_t* Z, int zu,
                        const int32_t* xt, const int32_t* xs, const float* xsc, int64_t K,
                        int64_t gs, int64_t L, int bits, int x8, int R, float* out) {
    switch (R) {
        VP_TILE_CASE(1)
        VP_TILE_CASE(2)
        VP_TILE_CASE(3)
        VP_TILE_CASE(4)
        VP_TILE_CASE(5)
        VP_TILE_CASE(6)
        VP_TILE_CASE(7)
        VP_TILE_CASE(8)
        VP_TILE_CASE(9)
        VP_TILE_CASE(10)
        VP_TILE_CASE(11)
        VP_TILE_CASE(12)
    }
}

/* Many rows (vp_wide_rows8/4 and more, exact x): a panel is walked chunk by chunk (L features),
   each chunk's codes widened once into the int16 pairs vp_tile makes of them, minus their zero
   points (64 B per feature: 8 KB, in L1, for groups of 128), and every tile of x meets that
   chunk before the next, instead of each tile masking and shifting the same codes again and
   subtracting z * sum(x) at each chunk's end. The same integer sums: sum((c - z) x) is sum(c x)
   - z sum(x) exactly (|c - z| <= 255 over L <= 256 features, <= 15 over L <= 2048: within
   int32), so the same bits. From how many rows (0: never), per code width: measured once per
   process on the running machine (cpu_vpanel.py), as it pays only where the products bound the
   loop (Xeon without AVX512-BF16, 2 threads, 0.6B shapes, in turns: 4-bit 1.05x at 16 rows,
   1.10-1.16x at 24-64, 1.21x at 160; 8-bit 0.83-0.96x at 12-32, 1.06x at 64, 1.16x at 160). */
int vp_wide_rows8 = 0, vp_wide_rows4 = 0;

/* Code dwords [q0, q1) of panel P as vp_tile's exact code vectors minus each lane's zero point
   (dword step q, half h, vector j at W + (((q - q0) * 2 + h) * nv + j) * 32). */
static void vp_widen(const uint32_t* P, const uint8_t* Z, int64_t q0, int64_t q1, int64_t Qend,
                     int64_t gs, int bits, int16_t* W) {
    const int nv = bits == 8 ? 2 : 4;
    const int64_t fpl = bits == 8 ? 4 : 8;
    for (int64_t q = q0; q < q1; q++) {
        const int64_t g = q * fpl / gs;
        if (q + (q1 - q0) < Qend) { /* the next chunk's codes, on their way while tiles run */
            _mm_prefetch((const char*)(P + VP_ROWS * (q + q1 - q0)), _MM_HINT_T1);
            _mm_prefetch((const char*)(P + VP_ROWS * (q + q1 - q0) + 16), _MM_HINT_T1);
        }
        for (int h = 0; h < 2; h++) {
            __m512i v[4];
            vp_pairs16(_mm512_loadu_si512(P + VP_ROWS * q + 16 * h), bits, v);
            __m512i z = _mm512_setzero_si512();
            if (Z) { /* each lane's zero point in both of its int16 halves */
                const __m128i z8 = _mm_loadu_si128((const __m128i*)(Z + VP_ROWS * g + 16 * h));
                z = _mm512_cvtepu8_epi32(z8);
                z = _mm512_or_si512(z, _mm512_slli_epi32(z, 16));
            }
            for (int j = 0; j < nv; j++)
                _mm512_store_si512(W + (((q - q0) * 2 + h) * nv + j) * 32,
                                   _mm512_sub_epi16(v[j], z));
        }
    }
}

/* One chunk of a widened panel (nq code dword steps at W; xc: the tile's x dwords of the
   chunk) against R rows of x: out[r][32] += (the integer sums as fp32) * sc. */
static inline __attribute__((always_inline)) void vp_tile_wide(const int16_t* W, const float* sc,
                                                                const int32_t* xc, int64_t nq,
                                                                const int bits, const int R,
                                                                float* out) {
    const int nv = bits == 8 ? 2 : 4;
    __m512i acc[VP_TILE][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t q = 0; q < nq; q++) {
        const int32_t* xp = xc + q * nv * R;
        for (int j = 0; j < nv; j++) {
            const __m512i w0 = _mm512_load_si512(W + ((q * 2) * nv + j) * 32);
            const __m512i w1 = _mm512_load_si512(W + ((q * 2 + 1) * nv + j) * 32);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i b = _mm512_set1_epi32(xp[j * R + r]);
                acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, b);
                acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], w1, b);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512 s = _mm512_loadu_ps(sc + 16 * h);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 f = _mm512_loadu_ps(out + 32 * r + 16 * h);
            _mm512_storeu_ps(out + 32 * r + 16 * h,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][h]), s, f));
        }
    }
}

#define VP_WIDE_CASE(n)                                                                    \
    case n:                                                                                \
        if (bits == 8) vp_tile_wide(W, sc, xc, nq, 8, n, out);                             \
        else vp_tile_wide(W, sc, xc, nq, 4, n, out);                                       \
        break;

static void vp_tile_wide_any(const int16_t* W, const float* sc, const int32_t* xc, int64_t nq,
                             int bits, int R, float* out) {
    switch (R) {
        VP_WIDE_CASE(1)
        VP_WIDE_CASE(2)
        VP_WIDE_CASE(3)
        VP_WIDE_CASE(4)
        VP_WIDE_CASE(5)
        VP_WIDE_CASE(6)
        VP_WIDE_CASE(7)
        VP_WIDE_CASE(8)
    }
}

/* Panel P against all M rows of x (tiles of VP_TILE, quantized exactly), fp32 results in
   out[M][32]: chunk by chunk, each widened once into W (L * 32 int16). A 4-bit tile of one
   row (its x laid out as split bytes) runs vp_tile over the codes as they are. */
static void vp_panel_wide(const uint32_t* P, const float* S, const uint8_t* Z, int zu,
                          const int32_t* xt, const int32_t* xs, int64_t M, int64_t K, int64_t gs,
                          int64_t L, int bits, int16_t* W, float* out) {
    const int nv = bits == 8 ? 2 : 4;
    const int64_t fpl = bits == 8 ? 4 : 8, nq = L / fpl, nch = K / L, xdw = K / 2;
    for (int64_t i = 0; i < M * VP_ROWS; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t c = 0; c < nch; c++) {
        vp_widen(P, Z, c * nq, (c + 1) * nq, K / fpl, gs, bits, W);
        const float* sc = S + VP_ROWS * (c * L / gs);
        for (int64_t m0 = 0; m0 < M; m0 += VP_TILE) {
            int R = M - m0 < VP_TILE ? (int)(M - m0) : VP_TILE;
            if (vp_split(bits, R)) continue;
            vp_tile_wide_any(W, sc, xt + m0 * xdw + c * nq * nv * R, nq, bits, R,
                             out + m0 * VP_ROWS);
        }
    }
    int64_t m0 = M - M % VP_TILE; /* the last tile, where it is one split row */
    if (m0 < M && vp_split(bits, (int)(M - m0)))
        vp_tile_any(P, S, Z, zu, xt + m0 * xdw, xs + m0 * nch, NULL, K, gs, L, bits, 0,
                    (int)(M - m0), out + m0 * VP_ROWS);
}

/* Panel p's zero points, or NULL where they are all 0 (the K-quants' codes are held with zero
   point 0), and in *zu their one value where they are all the same (Q6_K's 32, Q8_0's and
   IQ4's 128), else -1: its tiles then skip the zero-point term, or subtract that value times
   x's sum without a VPMULLD (vp_tile), the same bits (Q6_K-shaped weights, 8 rows, from
   memory: 1.05-1.06x as fast). Its G * 32 bytes are read here instead of in the tiles. */
static const uint8_t* vp_zero_points(const uint8_t* zeros, int64_t p, int64_t G, int* zu) {
    *zu = -1;
    if (!zeros) return NULL;
    const uint8_t* Z = zeros + p * G * VP_ROWS;
    const __m256i first = _mm256_set1_epi8((char)Z[0]);
    __m256i other = _mm256_setzero_si256();
    for (int64_t i = 0; i < G * VP_ROWS; i += 32)
        other = _mm256_or_si256(other, _mm256_xor_si256(first, _mm256_loadu_si256(
                                                            (const __m256i*)(Z + i))));
    if (!_mm256_testz_si256(other, other)) return Z;
    *zu = Z[0];
    return Z[0] ? Z : NULL;
}

/* y = x @ W.T over the panels, exact or with x in 8 bits (qgemv_x8, set per step). x is
   quantized once per call into tiles (rows interleaved per tile, see the quantizers), then
   the panels are shared among the threads (common.h), each panel against every tile. */
static void vp_matmul(int bits, const void* x, int x_bf16, const uint8_t* codes,
                      const float* scales, const uint8_t* zeros, void* y, int out_bf16,
                      int64_t M, int64_t N, int64_t K, int64_t gs) {
    const int x8 = qgemv_x8, T = x8 ? VP_TILE8 : VP_TILE;
    const int64_t L = x8 ? x8_block(gs) : chunk_len(bits, gs), nch = K / L, G = K / gs;
    const int64_t panels = N / VP_ROWS, pbytes = VP_ROWS * K * bits / 8;
    const int64_t xdw = x8 ? K / 4 : K / 2; /* x's dwords per row */
    int32_t* xt = aligned_alloc(64, ((M * xdw * 4 + 63) / 64) * 64);
    int32_t* xs = malloc(sizeof(int32_t) * M * nch);
    float* xsc = malloc(sizeof(float) * M * (x8 ? nch : 1)); /* per chunk, or per row */
    #pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++) {
        if (x8)
            vp_quantize_row8(x, x_bf16, m, M, K, bits, L, xt, xs + m * nch, xsc + m * nch);
        else
            xsc[m] = vp_quantize_row(x, x_bf16, m, M, K, bits, L, xt, xs + m * nch);
    }
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(shares, parts, panels);
    const int wide_rows = bits == 8 ? vp_wide_rows8 : vp_wide_rows4;
    const int wide = !x8 && wide_rows > 0 && M >= wide_rows;
    #pragma omp parallel
    {
        /* many rows: a widened chunk (L1) and every row's sums for a panel */
        int16_t* W = wide ? aligned_alloc(64, (size_t)L * VP_ROWS * 2) : NULL;
        float* all = wide ? aligned_alloc(64, sizeof(float) * M * VP_ROWS) : NULL;
        const int widened = W && all; /* else (out of memory too) tile by tile */
        for (int64_t p; (p = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            const uint32_t* P = (const uint32_t*)(codes + p * pbytes);
            const float* S = scales + p * G * VP_ROWS;
            int zu;
            const uint8_t* Z = vp_zero_points(zeros, p, G, &zu);
            float tile_out[VP_TILE8 * VP_ROWS] __attribute__((aligned(64)));
            if (widened) vp_panel_wide(P, S, Z, zu, xt, xs, M, K, gs, L, bits, W, all);
            for (int64_t m0 = 0; m0 < M; m0 += T) {
                int R = M - m0 < T ? (int)(M - m0) : T;
                float* out = widened ? all + m0 * VP_ROWS : tile_out;
                if (!widened)
                    vp_tile_any(P, S, Z, zu, xt + m0 * xdw, xs + m0 * nch,
                                x8 ? xsc + m0 * nch : NULL, K, gs, L, bits, x8, R, out);
                for (int r = 0; r < R; r++) {
                    __m512 rs = _mm512_set1_ps(x8 ? 1.0f : xsc[m0 + r]); /* x8: in each chunk */
                    for (int h = 0; h < 2; h++)
                        vp_store(y, out_bf16, (m0 + r) * N + p * VP_ROWS + 16 * h,
                                 _mm512_mul_ps(_mm512_loadu_ps(out + 32 * r + 16 * h), rs));
                }
            }
        }
        free(W);
        free(all);
    }
    free(xt);
    free(xs);
    free(xsc);
}

/* Rows [start, end) of a packed weight dequantized into out (fp32, row-major [end - start,
   K]): the values qdequant.c's row-major dequantizer (and qtensor.dequantize) give, (code -
   zero) * scale in fp32, for an embedding lookup of a tied table packed for its LM head.
   qdequant's arguments (the strides unused). */
static void vp_dequant_rows(int bits, const uint8_t* codes, const float* scales,
                            const uint8_t* zeros, float* out, int64_t start, int64_t end,
                            int64_t K, int64_t gs) {
    const int64_t per = bits == 8 ? 4 : 8, Q = K / per, G = K / gs;
    const uint32_t mask = bits == 8 ? 0xFF : 0x0F;
    for (int64_t n = start; n < end; n++) {
        const int64_t p = n / VP_ROWS, lane = n % VP_ROWS;
        const uint32_t* P = (const uint32_t*)(codes + p * (VP_ROWS * K * bits / 8));
        const float* S = scales + p * G * VP_ROWS;
        const uint8_t* Z = zeros ? zeros + p * G * VP_ROWS : NULL;
        float* row = out + (n - start) * K;
        for (int64_t q = 0; q < Q; q++) {
            uint32_t d = P[q * VP_ROWS + lane];
            for (int64_t j = 0; j < per; j++) {
                int64_t k = q * per + j, g = k / gs;
                float z = Z ? (float)Z[g * VP_ROWS + lane] : 0.0f;
                float c = (float)((d >> (bits * j)) & mask);
                row[k] = (c - z) * S[g * VP_ROWS + lane];
            }
        }
    }
}

void qvpanel_rows_u8(const uint8_t* codes, int64_t cstride, const float* scales,
                     const uint8_t* zeros, int64_t gstride, float* out, int64_t start,
                     int64_t end, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    vp_dequant_rows(8, codes, scales, zeros, out, start, end, K, gs);
}
void qvpanel_rows_u4(const uint8_t* codes, int64_t cstride, const float* scales,
                     const uint8_t* zeros, int64_t gstride, float* out, int64_t start,
                     int64_t end, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    vp_dequant_rows(4, codes, scales, zeros, out, start, end, K, gs);
}

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (fp32, or bf16 where x_bf16) @ W.T, W in
   the panel layout above; qgemv's arguments (the strides unused: the panels are contiguous). */
void qvpanel_u8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
                int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    vp_matmul(8, x, x_bf16, codes, scales, zeros, y, out_bf16, M, N, K, gs);
}
void qvpanel_u4(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
                int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    vp_matmul(4, x, x_bf16, codes, scales, zeros, y, out_bf16, M, N, K, gs);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* The same panels on AMX-INT8 tiles (`amx_vpanel`, cpu_vpanel.py), the same bits as
   vp_matmul's exact form: y = x @ W.T with C = x . W^T, A = x's rows, B = the panel as it
   lies. AMX-INT8's B operand is the VNNI layout (row kq: 4 bytes of one feature quad per
   output column): 8-bit panels are B tiles as they are (16 quads x 16 rows, the panel's
   128-byte quad rows read 64 bytes at a time: two B tiles a step, one per half of the
   panel), so a step streams 2 KB of contiguous codes; 4-bit panels are split into low and
   high nibbles first (a quad row's low nibbles are features 8q + 0, 2, 4, 6, its high ones
   8q + 1, 3, 5, 7), and x's bytes are laid out per step as the codes are: the even features,
   then the odd ones.

   Why: the row-major codes' AMX kernel (qamxi.c, `amx_int`) loads its A tiles as 16 rows
   K bytes apart, so the memory sees 32 short runs at once and the hardware prefetcher
   follows none of them; at 8 rows on 2 threads it read 8-bit codes at 15-17 GB/s where one
   row's GEMV reads 28-29 (Xeon, Sapphire Rapids class under KVM). Here the codes are one
   run per panel and the A operand is x: a tile product's time follows x's rows, not 16.

   Numerics (exactly vp_matmul's, so a weight can take either per row count): x quantized
   per row to int16 as vp_quantize_row; AMX multiplies bytes, so xq = 256 * hi + lo (hi
   signed, lo unsigned): TDPBSUD (hi x codes) and TDPBUUD (lo x codes) into two int32 sums
   per chunk of L features (chunk_len: |256 * hi_sum + lo_sum| fits int32), combined, less
   the zero point times the chunk's x sum, in int32, then fp32 times the group's scale added
   to the output's fp32 sum, chunk by chunk; the row's scale last. 4-bit codes have their zero
   points subtracted as they are split into bytes (signed, |code - zero| <= 15), so their
   products are TDPBSSD and TDPBUSD and their sums need no zero-point term: the same int32
   sums with a third less work per fold (4-bit g128, 32 rows 451-466 -> 424-452 us, 128 rows
   1219 -> 1094-1111, cold, 6144x1024, 2 threads, Intel Xeon with AMX).

   Under --cpu-quantized-activations int8 (qgemv_x8) x is rounded as vp_matmul's 8-bit form
   rounds it (qv_quantize_block per chunk of gcd(group, 128) features), its codes one A tile
   a step: one tile product (TDPBSUD; 4-bit TDPBSSD), half the products and A loads of the
   exact form, folded per chunk with the chunk's x scale: vp_tile's 8-bit bits. Before, that
   mode ran vnni_panel's 8-bit form here. 2 threads, cold panels, 6144x1024, against
   vnni_panel's 8-bit form and the exact tiles, in the same runs (before the 4-bit codes' zero
   points went into their split): 4-bit codes at 32 rows 375 us (466, 454), 128 rows 1003 (1595,
   1225); 8-bit at 32 rows 420 (598, 482), 128 rows 1083 (1718, 1065) (Intel Xeon, AMX). */
#include "amx.h"

/* Chunks' sums are folded VA_LAG chunks after their tiles were stored, and 4-bit codes split
   VA_LAG chunks before their tiles load them (qamxi.c: a vector load of lines a tile store
   left in the store buffer, or a tile load after vector stores, waits for them). */
#define VA_LAG 2
/* The codes a step reads are prefetched this far ahead, into L1 (the Xeon above, 2 threads,
   cold panels, 6144x1024 and 1024x3072: 8-bit at 8 rows 17.8 -> 21.2 and 16.7 -> 20.3 GB/s, 1
   row 20.1 -> 23.2 and 19.7 -> 23.0; 4-bit at 1 row 12.9 -> 14.6; 2 KB and 8 KB ahead, or
   into L2, no better; at 32 rows no change: the products bound them). */
#define VA_PF_BYTES 4096

typedef struct {
    int bits, x8;
    int64_t S, M, N, K, gs, L, nch, steps, mtiles;
    const uint8_t* codes;
    const float* scales;
    const uint8_t* zeros;
    uint8_t* xa;  /* [mtiles][steps][2][16][64]: x's high bytes' A tile, then its low bytes'
                     (x8: [mtiles][steps][16][64], x's 8-bit codes' one A tile) */
    int32_t* xs;  /* [M][nch]: each chunk's sum of x's int16 (x8: int8) codes */
    float* xsc;   /* [M]: each row's scale (x8: [M][nch], each chunk's) */
} VaCall;

/* Row m of x -> its int16 codes (vp_quantize_row's), its chunks' sums and scale, and its
   bytes in the A tiles' step layout. */
static void va_prepare_row(VaCall* c, const void* x, int x_bf16, int64_t m, int16_t* tmp) {
    const int64_t K = c->K, S = c->S;
    float s = c->xsc[m] = vp_row_scale(x, x_bf16, m, K);
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    for (int64_t c0 = 0; c0 < K; c0 += c->L) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = c0; k < c0 + c->L; k += 16) {
            __m512i q = vp_q16(x, x_bf16, m * K + k, inv);
            sum = _mm512_add_epi32(sum, q);
            _mm256_storeu_si256((__m256i*)(tmp + k), _mm512_cvtepi32_epi16(q));
        }
        c->xs[m * c->nch + c0 / c->L] = _mm512_reduce_add_epi32(sum);
    }
    /* 4-bit steps: of 64 features the 32 even ones, then the 32 odd; of 32, 16 and 16 */
    int16_t order[32] __attribute__((aligned(64)));
    for (int i = 0; i < 32; i++) order[i] = (int16_t)(S == 64 || i < 16 ? 2 * i : 2 * i - 31);
    const __m512i even = _mm512_load_si512((const void*)order);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    const int64_t mt = m / 16, r = m % 16;
    for (int64_t t = 0; t < c->steps; t++) {
        uint8_t* hi = c->xa + ((mt * c->steps + t) * 2) * 1024 + r * 64;
        uint8_t* lo = hi + 1024;
        const int16_t* q = tmp + t * S;
        for (int64_t h = 0; h < S / 32; h++) {
            __m512i v;
            if (c->bits == 8) {
                v = _mm512_loadu_si512((const void*)(q + 32 * h));
            } else if (S == 64) {
                __m512i a = _mm512_loadu_si512((const void*)q);
                __m512i b = _mm512_loadu_si512((const void*)(q + 32));
                v = _mm512_permutex2var_epi16(a, h ? odd : even, b);
            } else {
                v = _mm512_permutexvar_epi16(even, _mm512_loadu_si512((const void*)q));
            }
            _mm256_storeu_si256((__m256i*)(hi + 32 * h),
                                _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
            _mm256_storeu_si256((__m256i*)(lo + 32 * h), _mm512_cvtepi16_epi8(v));
        }
    }
}

/* Row m of x rounded to 8 bits (qv_quantize_block per chunk: vnni_panel's 8-bit codes, sums and
   scales) and laid out as the A tile of each step, in the step's feature order as
   va_prepare_row lays out the int16 codes' bytes. */
static void va_prepare_row8(VaCall* c, const void* x, int x_bf16, int64_t m, int8_t* tmp) {
    const int64_t K = c->K, S = c->S, L = c->L, nch = c->nch;
    for (int64_t j = 0; j < nch; j++)
        c->xsc[m * nch + j] = qv_quantize_block(x, x_bf16, m * K + j * L, L, tmp + j * L,
                                                &c->xs[m * nch + j]);
    const int64_t mt = m / 16, r = m % 16;
    for (int64_t t = 0; t < c->steps; t++) {
        int8_t* dst = (int8_t*)c->xa + (mt * c->steps + t) * 1024 + r * 64;
        const int8_t* q = tmp + t * S;
        if (c->bits == 8)
            __builtin_memcpy(dst, q, (size_t)S);
        else /* the step's even features, then its odd ones */
            for (int64_t i = 0; i < S / 2; i++) {
                dst[i] = q[2 * i];
                dst[S / 2 + i] = q[2 * i + 1];
            }
    }
}

/* 4-bit codes of chunk i of panel p (codes P) -> B tiles in ubuf [steps][2 halves][S / 4][64]:
   per step its S / 8 quad rows' low nibbles, then their high nibbles, each less its column's
   zero point (a chunk lies in one group): signed bytes in [-15, 15], so the tile products sum
   x . (code - zero) and the fold has no zero-point term to subtract (the same int32 sums). */
static inline void va_split_chunk(const VaCall* c, const uint8_t* P, int64_t p, uint8_t* ubuf,
                                  int64_t i) {
    const int64_t S = c->S, rows = S / 8, G = c->K / c->gs, g = i * c->L / c->gs;
    const __m512i n4 = _mm512_set1_epi32(0x0F0F0F0F);
    __m512i z[2]; /* per half: each column's zero point in the 4 bytes of its dword */
    for (int h = 0; h < 2; h++) {
        const uint8_t* zp = c->zeros ? c->zeros + (p * G + g) * VP_ROWS + 16 * h : NULL;
        z[h] = zp ? _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)zp)),
                                       _mm512_set1_epi32(0x01010101))
                  : _mm512_setzero_si512();
    }
    for (int64_t k = i * c->L; k < (i + 1) * c->L; k += S) {
        const int64_t t = k / S;
        for (int64_t j = 0; j < rows; j++) {
            const uint8_t* src = P + (k / 8 + j) * 128;
            _mm_prefetch((const char*)src + VA_PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char*)src + VA_PF_BYTES + 64, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m512i d = _mm512_loadu_si512((const void*)(src + 64 * h));
                uint8_t* dst = ubuf + ((t * 2 + h) * (S / 4)) * 64;
                __m512i lo = _mm512_and_si512(d, n4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(d, 4), n4);
                _mm512_store_si512((void*)(dst + j * 64), _mm512_sub_epi8(lo, z[h]));
                _mm512_store_si512((void*)(dst + (rows + j) * 64), _mm512_sub_epi8(hi, z[h]));
            }
        }
    }
}

/* t less the zero points z times the row's x sum (8-bit codes with zero points). */
static inline __m512i va_less_zero(__m512i t, int zero, __m512i z, int32_t xsum) {
    return zero ? _mm512_sub_epi32(t, _mm512_mullo_epi32(z, _mm512_set1_epi32(xsum))) : t;
}

/* Chunk j's four C tiles (cb: hi x half 0, lo x half 0, hi x half 1, lo x half 1, 16 rows of
   16 int32 each; x8: the 8-bit codes' x half 0 and x half 1 in the places of the hi ones) into
   the fp32 sums acc[r][32] of the m-tile's `mr` rows, less the zero points times the chunk's
   x sums for 8-bit codes (4-bit ones had them taken off in va_split_chunk); x8 with each
   chunk's x scale, as vp_tile's 8-bit form folds. */
static inline void va_fold(const VaCall* c, const int32_t* cb, int64_t p, int64_t m0,
                           int64_t mr, int64_t j, float* __restrict acc) {
    /* The call's fields in locals and a loop per form: with acc's stores in one loop for both,
       GCC reloaded the fields and tested the form per row (x in 8 bits, 2 threads, a Xeon
       with AMX, 6144x1024 4-bit g128: 64 rows 403-432 -> 363-383 us, 32 rows 1.02x). */
    const int64_t G = c->K / c->gs, g = j * c->L / c->gs, nch = c->nch;
    const int zero = c->zeros && c->bits == 8;
    const int32_t* xs = c->xs + m0 * nch + j;
    for (int h = 0; h < 2; h++) {
        const int64_t at = (p * G + g) * VP_ROWS + 16 * h;
        const __m512 sc = _mm512_loadu_ps(c->scales + at);
        const __m128i z8 =
            zero ? _mm_loadu_si128((const __m128i*)(c->zeros + at)) : _mm_setzero_si128();
        const __m512i z = _mm512_cvtepu8_epi32(z8);
        const int32_t* th = cb + (2 * h) * 256;
        const int32_t* tl = th + 256;
        float* f = acc + 16 * h;
        if (c->x8) { /* each chunk with its own x scale */
            const float* xsc = c->xsc + m0 * nch + j;
            for (int64_t r = 0; r < mr; r++, f += 32) {
                __m512i t = va_less_zero(_mm512_load_si512(th + 16 * r), zero, z, xs[r * nch]);
                const __m512 scale = _mm512_mul_ps(sc, _mm512_set1_ps(xsc[r * nch]));
                _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale,
                                                   _mm512_load_ps(f)));
            }
        } else { /* x's high bytes' sums times 256 plus its low bytes' */
            for (int64_t r = 0; r < mr; r++, f += 32) {
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(th + 16 * r), 8),
                                             _mm512_load_si512(tl + 16 * r));
                t = va_less_zero(t, zero, z, xs[r * nch]);
                _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, _mm512_load_ps(f)));
            }
        }
    }
}

/* Panel p against every m-tile of x. */
static void va_panel(const VaCall* c, int64_t p, uint8_t* ubuf, int32_t* cbuf, float* acc,
                     void* y, int out_bf16) {
    const int64_t S = c->S, nch = c->nch, tb = (S / 4) * 64;
    const uint8_t* P = c->codes + p * VP_ROWS * c->K * c->bits / 8;
    const int u4 = c->bits == 4;
    const int64_t xstep = c->x8 ? 1024 : 2048; /* A tile bytes per step */
    for (int64_t mt = 0; mt < c->mtiles; mt++) {
        const int64_t m0 = mt * 16, mr = c->M - m0 < 16 ? c->M - m0 : 16;
        const int split = u4 && mt == 0;
        const uint8_t* xa = c->xa + mt * c->steps * xstep;
        memset(acc, 0, sizeof(float) * 32 * 16);
        for (int64_t i = 0; split && i < VA_LAG && i < nch; i++) va_split_chunk(c, P, p, ubuf, i);
        for (int64_t i = 0; i < nch + VA_LAG; i++) {
            if (i < nch) {
                if (split && i + VA_LAG < nch) va_split_chunk(c, P, p, ubuf, i + VA_LAG);
                _tile_zero(0);
                _tile_zero(2);
                if (!c->x8) {
                    _tile_zero(1);
                    _tile_zero(3);
                }
                for (int64_t k = i * c->L, t = k / S; k < (i + 1) * c->L; k += S, t++) {
                    _tile_loadd(4, xa + t * xstep, 64);
                    if (!c->x8) _tile_loadd(5, xa + t * xstep + 1024, 64);
                    if (u4) {
                        _tile_loadd(6, ubuf + (t * 2) * tb, 64);
                        _tile_loadd(7, ubuf + (t * 2 + 1) * tb, 64);
                    } else {
                        const char* ahead = (const char*)P + k * VP_ROWS + VA_PF_BYTES;
                        for (int64_t l = 0; l < S * VP_ROWS; l += 64)
                            _mm_prefetch(ahead + l, _MM_HINT_T0);
                        _tile_loadd(6, P + k * VP_ROWS, 128);
                        _tile_loadd(7, P + k * VP_ROWS + 64, 128);
                    }
                    if (u4) { /* signed codes less their zero points (va_split_chunk) */
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(2, 4, 7);
                        if (c->x8) continue;
                        _tile_dpbusd(1, 5, 6);
                        _tile_dpbusd(3, 5, 7);
                    } else {
                        _tile_dpbsud(0, 4, 6);
                        _tile_dpbsud(2, 4, 7);
                        if (c->x8) continue;
                        _tile_dpbuud(1, 5, 6);
                        _tile_dpbuud(3, 5, 7);
                    }
                }
                int32_t* cb = cbuf + (i % (VA_LAG + 1)) * 1024;
                _tile_stored(0, cb, 64);
                _tile_stored(2, cb + 512, 64);
                if (!c->x8) {
                    _tile_stored(1, cb + 256, 64);
                    _tile_stored(3, cb + 768, 64);
                }
            }
            if (i >= VA_LAG)
                va_fold(c, cbuf + ((i - VA_LAG) % (VA_LAG + 1)) * 1024, p, m0, mr, i - VA_LAG,
                        acc);
        }
        for (int64_t r = 0; r < mr; r++) {
            __m512 rs = _mm512_set1_ps(c->x8 ? 1.0f : c->xsc[m0 + r]); /* x8: in each chunk */
            for (int h = 0; h < 2; h++)
                vp_store(y, out_bf16, (m0 + r) * c->N + p * VP_ROWS + 16 * h,
                         _mm512_mul_ps(_mm512_load_ps(acc + 32 * r + 16 * h), rs));
        }
    }
}

static void va_matmul(int bits, const void* x, int x_bf16, const uint8_t* codes,
                      const float* scales, const uint8_t* zeros, void* y, int out_bf16,
                      int64_t M, int64_t N, int64_t K, int64_t gs) {
    if (M <= 0) return; /* no rows: tiles of 0 rows are no valid configuration */
    const int x8 = qgemv_x8;
    const int64_t L = x8 ? x8_block(gs) : chunk_len(bits, gs), S = L % 64 == 0 ? 64 : 32;
    VaCall c = {bits, x8, S, M, N, K, gs, L, K / L, K / S, (M + 15) / 16,
                codes, scales, zeros, NULL, NULL, NULL};
    /* rows of the last m-tile past M stay zero: multiplied, never stored */
    const size_t xa_bytes = (size_t)(c.mtiles * c.steps * (x8 ? 1024 : 2048));
    c.xa = (uint8_t*)aligned_alloc(64, xa_bytes);
    memset(c.xa, 0, xa_bytes);
    c.xs = (int32_t*)malloc(sizeof(int32_t) * M * c.nch);
    c.xsc = (float*)malloc(sizeof(float) * M * (x8 ? c.nch : 1));
    const int64_t panels = N / VP_ROWS, mr = M < 16 ? M : 16;
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(shares, parts, panels);
    #pragma omp parallel
    {
        int16_t* tmp = (int16_t*)aligned_alloc(64, sizeof(int16_t) * K);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (x8)
                va_prepare_row8(&c, x, x_bf16, m, (int8_t*)tmp);
            else
                va_prepare_row(&c, x, x_bf16, m, tmp);
        }
        free(tmp);
        AmxConfig cfg;
        amx_config_init(&cfg);
        for (int t = 0; t < 4; t++) amx_config_tile(&cfg, t, (int)mr, 64);
        amx_config_tile(&cfg, 4, (int)mr, (int)S);
        amx_config_tile(&cfg, 5, (int)mr, (int)S);
        amx_config_tile(&cfg, 6, (int)(S / 4), 64);
        amx_config_tile(&cfg, 7, (int)(S / 4), 64);
        amx_config(&cfg);
        uint8_t* ubuf = bits == 4 ? (uint8_t*)aligned_alloc(64, (size_t)(VP_ROWS * K)) : NULL;
        int32_t* cbuf = (int32_t*)aligned_alloc(64, sizeof(int32_t) * (VA_LAG + 1) * 1024);
        float* acc = (float*)aligned_alloc(64, sizeof(float) * 32 * 16);
        for (int64_t p; (p = share_next(shares, parts, omp_get_thread_num())) >= 0;)
            va_panel(&c, p, ubuf, cbuf, acc, y, out_bf16);
        amx_release();
        free(ubuf);
        free(cbuf);
        free(acc);
    }
    free(c.xa);
    free(c.xs);
    free(c.xsc);
}

/* 1 where the AMX form may run (the tiles granted to this process), else 0. */
int qvpanel_amx_ready(void) { return amx_ready(); }

/* vnni_panel's entry points on AMX tiles: the same arguments, layout and bits. */
void qvpanel_amx_u8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                    const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
                    int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    va_matmul(8, x, x_bf16, codes, scales, zeros, y, out_bf16, M, N, K, gs);
}
void qvpanel_amx_u4(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                    const float* scales, const uint8_t* zeros, int64_t gstride, void* y,
                    int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride;
    va_matmul(4, x, x_bf16, codes, scales, zeros, y, out_bf16, M, N, K, gs);
}
#endif

#if defined(__AVX512VBMI__)
/* fp8 e4m3 codes in 32-row panels, against bf16 x with VDPBF16PS (the bf16 panels' product,
   panel512.c), for any number of rows: the fp8 codes' one-row path (qgemv.c) spends 13
   instructions per 32 codes turning them into fp32; here a line of 64 codes becomes two
   vectors of bf16 pairs in five (two byte lookups, a sign, two unpacks). On CPUs without
   AVX512-BF16 (Ice Lake) x is widened to fp32 once per call and each pair splits into its two
   fp32 weights by a shift and a mask for two FMAs (the same exact products; the sums in
   another order than VDPBF16PS's): four more instructions a line.

   Layout (cpu_vpanel.pack): codes [N/32][K/2][32][2] bytes, a line is the 32 rows' codes of
   features 2q, 2q+1, the rows of each 16-byte lane of the line in the order the unpacks need
   (rows 4L..4L+3, then 16+4L..16+4L+3: FP8_ROW_ORDER in cpu_vpanel.py) so that the low
   unpack holds rows 0-15 and the high one rows 16-31; scales [N/32][G][32] floats.

   Numerics: every e4m3 value (subnormals included) is a bf16 exactly (the lookup tables are
   its bits), so each product x_k * w_k is exact in fp32; per group of gs features the
   products are summed in fp32 by VDPBF16PS, two features a step, then multiplied by the
   group's scale into the row's fp32 sum. One accumulator per output lane whatever the tile
   (at one row ~33 GB/s of codes a core from L3 on a Zen 4, about the memory's fast rate per
   core; two chains ran only 1.08x as fast), so a row's result does not depend on the rows
   beside it, the tile it falls in, the row count or the thread count. */

#define F8_TILE 8

/* The bf16 bits of e4m3 code c (0-127, the sign apart) as two byte tables of 128, built once
   when the library loads (per call they cost ~0.7 us, ~110 calls a decode step). */
static uint8_t f8_lo[128] __attribute__((aligned(64))), f8_hi[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void f8_tables(void) {
    for (int c = 0; c < 128; c++) {
        int e = c >> 3, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        uint16_t b = c == 127 ? 0x7FC0 : (uint16_t)(u >> 16); /* e4m3fn's NaN */
        f8_lo[c] = (uint8_t)b;
        f8_hi[c] = (uint8_t)(b >> 8);
    }
}

typedef struct {
    __m512i lo0, lo1, hi0, hi1;
} F8Tables;

/* A line of 64 codes -> rows 0-15 (w[0]) and 16-31 (w[1]) as bf16 pairs. */
static inline __attribute__((always_inline)) void f8_line(const F8Tables* t, const uint8_t* p,
                                                          __m512i* w) {
    const __m512i d = _mm512_loadu_si512(p);
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, d, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, d, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, d, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | d & s */
    w[0] = _mm512_unpacklo_epi8(lo, hi);
    w[1] = _mm512_unpackhi_epi8(lo, hi);
}

#ifdef __AVX512BF16__
typedef uint16_t F8X; /* x as the products take it: bf16 pairs */
/* acc += the line's pairs (w) times x's pair at xk (features k, k + 1). */
static inline __attribute__((always_inline)) __m512 f8_dot(__m512 acc, __m512i w, const F8X* xk) {
    uint32_t pair;
    memcpy(&pair, xk, sizeof pair);
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)pair));
}
#else
typedef float F8X; /* x widened to fp32 (qvpanel_fp8) */
static inline __attribute__((always_inline)) __m512 f8_dot(__m512 acc, __m512i w, const F8X* xk) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    acc = _mm512_fmadd_ps(we, _mm512_set1_ps(xk[0]), acc);
    return _mm512_fmadd_ps(wo, _mm512_set1_ps(xk[1]), acc);
}
#endif

/* One panel against R rows of x (rows x_stride apart): fp32 results in out[r][32]. `mode` 0:
   the lines from the codes; 1: from the codes, kept in `lines` (two vectors a line) for the
   panel's next tiles; 2: from `lines`, which a tile in mode 1 filled (the same pairs, so the
   same bits, without five instructions a line per tile). */
static inline __attribute__((always_inline)) void f8_tile(const F8Tables* t, const uint8_t* P,
                                                          const float* S, const F8X* x,
                                                          int64_t x_stride, int64_t K,
                                                          int64_t gs, const int R, float* out,
                                                          __m512i* lines, const int mode) {
    for (int r = 0; r < 2 * R; r++) _mm512_storeu_ps(out + 16 * r, _mm512_setzero_ps());
    const int row_pf = vp_row_prefetch; /* few rows: as vnni_panel's one row (measured) */
    for (int64_t g0 = 0; g0 < K; g0 += gs) {
        __m512 acc[F8_TILE][2];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t k = g0; k < g0 + gs; k += 2) {
            __m512i w[2];
            if (mode == 2) {
                w[0] = _mm512_load_si512(lines + k);
                w[1] = _mm512_load_si512(lines + k + 1);
            } else {
                const uint8_t* line = P + (k / 2) * 2 * VP_ROWS;
                vp_prefetch(line, R, row_pf);
                f8_line(t, line, w);
                if (mode == 1) {
                    _mm512_store_si512(lines + k, w[0]);
                    _mm512_store_si512(lines + k + 1, w[1]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                acc[r][0] = f8_dot(acc[r][0], w[0], x + r * x_stride + k);
                acc[r][1] = f8_dot(acc[r][1], w[1], x + r * x_stride + k);
            }
        }
        const int64_t g = g0 / gs;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512 sc = _mm512_loadu_ps(S + VP_ROWS * g + 16 * h);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                float* o = out + 32 * r + 16 * h;
                _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[r][h], sc, _mm512_loadu_ps(o)));
            }
        }
    }
}

#define F8_ROWS(MODE)                                                                          \
    switch (R) {                                                                               \
        case 1: f8_tile(t, P, S, x, x_stride, K, gs, 1, out, lines, MODE); break;              \
        case 2: f8_tile(t, P, S, x, x_stride, K, gs, 2, out, lines, MODE); break;              \
        case 3: f8_tile(t, P, S, x, x_stride, K, gs, 3, out, lines, MODE); break;              \
        case 4: f8_tile(t, P, S, x, x_stride, K, gs, 4, out, lines, MODE); break;              \
        case 5: f8_tile(t, P, S, x, x_stride, K, gs, 5, out, lines, MODE); break;              \
        case 6: f8_tile(t, P, S, x, x_stride, K, gs, 6, out, lines, MODE); break;              \
        case 7: f8_tile(t, P, S, x, x_stride, K, gs, 7, out, lines, MODE); break;              \
        default: f8_tile(t, P, S, x, x_stride, K, gs, 8, out, lines, MODE); break;             \
    }

static void f8_tile_any(const F8Tables* t, const uint8_t* P, const float* S, const F8X* x,
                        int64_t x_stride, int64_t K, int64_t gs, int R, float* out,
                        __m512i* lines, int mode) {
    if (mode == 2) F8_ROWS(2)
    else if (mode == 1) F8_ROWS(1)
    else F8_ROWS(0)
}

/* qgemv's arguments (the strides unused); x must be bf16 (x_bf16 = 1): the panels multiply
   bf16 pairs, and the chooser offers them for bf16 x only. */
void qvpanel_fp8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
                 const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
                 int64_t M, int64_t N, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride, (void)zeros;
    if (!x_bf16) return; /* never offered: cpu_vpanel.takes */
    F8Tables t = {_mm512_load_si512(f8_lo), _mm512_load_si512(f8_lo + 64),
                  _mm512_load_si512(f8_hi), _mm512_load_si512(f8_hi + 64)};
    const int64_t panels = N / VP_ROWS, G = K / gs;
#ifdef __AVX512BF16__
    const F8X* xs = (const F8X*)x;
#else
    F8X* xs = (F8X*)aligned_alloc(64, sizeof(F8X) * M * K); /* K % 32 == 0 */
    widen_bf16(x, M * K, xs);
#endif
    Share shares[SHARE_MAX] __attribute__((aligned(64)));
    int parts = share_parts();
    shares_init(shares, parts, panels);
    /* More than one tile of rows: a panel's lines made once, by its first tile (K / 2 lines of
       128 bytes a thread), and read by the others. */
    const int keep = M > F8_TILE;
    #pragma omp parallel
    {
        __m512i* lines = keep ? (__m512i*)aligned_alloc(64, (size_t)K * 64) : 0;
        for (int64_t p; (p = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            const uint8_t* P = codes + p * VP_ROWS * K;
            const float* S = scales + p * G * VP_ROWS;
            float out[F8_TILE * VP_ROWS] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += F8_TILE) {
                int R = M - m0 < F8_TILE ? (int)(M - m0) : F8_TILE;
                int mode = !lines ? 0 : m0 == 0 ? 1 : 2;
                f8_tile_any(&t, P, S, xs + m0 * K, K, K, gs, R, out, lines, mode);
                for (int r = 0; r < R; r++)
                    for (int h = 0; h < 2; h++)
                        vp_store(y, out_bf16, (m0 + r) * N + p * VP_ROWS + 16 * h,
                                 _mm512_loadu_ps(out + 32 * r + 16 * h));
            }
        }
        free(lines);
    }
#ifndef __AVX512BF16__
    free(xs);
#endif
}

/* Rows [start, end) of a packed fp8 weight as fp32 (code * scale, qdequant's values). */
void qvpanel_rows_fp8(const uint8_t* codes, int64_t cstride, const float* scales,
                      const uint8_t* zeros, int64_t gstride, float* out, int64_t start,
                      int64_t end, int64_t K, int64_t gs) {
    (void)cstride, (void)gstride, (void)zeros;
    const int64_t G = K / gs;
    for (int64_t n = start; n < end; n++) {
        const int64_t p = n / VP_ROWS, r = n % VP_ROWS;
        /* the row's slot in a line: lane L holds rows 4L..4L+3 then 16+4L..16+4L+3 */
        const int64_t slot = r < 16 ? (r / 4) * 8 + r % 4 : ((r - 16) / 4) * 8 + 4 + r % 4;
        const uint8_t* P = codes + p * VP_ROWS * K;
        const float* S = scales + p * G * VP_ROWS;
        for (int64_t k = 0; k < K; k++) {
            uint8_t c = P[(k / 2) * 2 * VP_ROWS + slot * 2 + k % 2];
            uint32_t u = ((uint32_t)(c & 0x80) << 24) | ((uint32_t)f8_hi[c & 0x7F] << 24) |
                         ((uint32_t)f8_lo[c & 0x7F] << 16);
            float v;
            memcpy(&v, &u, sizeof v);
            out[(n - start) * K + k] = v * S[(k / gs) * VP_ROWS + r];
        }
    }
}
#endif

#endif
