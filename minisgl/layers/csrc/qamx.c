/* Many rows (prefill) over quantized weights on AMX: y[M, N] = x[M, K] @ W.T with x in bf16,
   W as minisgl/quant/qtensor.py holds it (codes, per-row per-group scales and zero points).

   The fp32 panel kernels (qdequant.c) run at the FMA units' rate; a bf16 model's prefill
   runs on AMX tiles (oneDNN, ~10x that on a Sapphire Rapids core), so a quantized prefill on
   them took 4-6x bf16's time. Here each thread dequantizes a panel of NP weight rows ONCE per
   call into bf16, in the layout AMX's B operand reads (VNNI pairs: [K/2][16 rows][2
   features]), and every 32 input rows then multiply it with TDPBF16PS: x's rows are the A
   tiles straight from memory (16 rows x 32 features, no packing), the weight the B tiles,
   fp32 sums in 4 C tiles (2 x 2: one tile load per dot product). The panel (NP x K bf16,
   <= ~768 KB) stays in L2 while all of x passes over it, so no weight byte is read twice
   from memory and the dequantization costs ~1/M of the arithmetic per weight.

   Values: qtensor.dequantize's fp32 ((code - zero) exact, one rounding in the multiply by the
   scale, one more in subtracting a group's min where the weight has them: the *_mins entry
   points, GGUF's Q4_K / Q4_1 / Q2_K ...) rounded once to bf16 (nearest even), the weights a
   bf16 twin of the dequantized model holds; products exact in fp32, sums in fp32. A min
   folded into the panel costs nothing per row of x, where qmins.c's term after the matmul
   (M x N x groups multiply-adds) took ~a third of what such a prefill lost to bf16's. fp8
   e4m3 widens exactly through fp16, times 2^-8 folded into the scale (as qdequant.c).

   Compiled where the build targets AMX-TILE, AMX-BF16 and AVX512-BF16 (cpu_build.py); the
   entry points run only after amx_ready() (amx.h) granted the tiles. A build with
   AVX512-BF16 and no AMX (AMD Zen 4) has the same entry points over VDPBF16PS register
   tiles instead (below: 2.1-2.5x faster than the fp32 panel there, 1.0-1.1x the time of
   oneDNN's bf16 matmul on the bf16 weight, 320-512 rows, one thread of a Zen 4 EPYC);
   other builds have none. */
#include "common.h"
#include "amx.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

/* QA_P8 / QA_P4: integer codes in vnni_panel's packed panels (qvpanel.c, cpu_vpanel.py). */
enum { QA_U8 = 0, QA_U4 = 1, QA_FP8 = 2, QA_P8 = 3, QA_P4 = 4 };

#define QA_PANEL_BYTES (768 << 10) /* a thread's dequantized panel: within L2 */

/* 32 codes of a row from feature k (one group: gs % 32 == 0) -> 32 bf16 in feature order,
   as 16 dwords: dword p holds features k + 2p (low half) and k + 2p + 1. */
static inline __attribute__((always_inline)) __m512i qa_deq32(int kind, const uint8_t* c,
                                                               int64_t k, float scale,
                                                               float zero, float min) {
    __m512 a, b;
    if (kind == QA_FP8) { /* byte -> top of an fp16, sign kept, exponent+mantissa down one */
        __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + k)));
        h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(h, 8), 1),
                             _mm512_set1_epi16((short)0xBFFF));
        __m512 s = _mm512_set1_ps(scale * 256.0f);
        a = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
        b = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    } else {
        __m128i lo, hi;
        if (kind == QA_U8) {
            lo = _mm_loadu_si128((const __m128i*)(c + k));
            hi = _mm_loadu_si128((const __m128i*)(c + k + 16));
        } else { /* 16 bytes, feature 2j in the low nibble of byte j */
            __m128i v = _mm_loadu_si128((const __m128i*)(c + k / 2));
            __m128i l = _mm_and_si128(v, _mm_set1_epi8(0x0F));
            __m128i h = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
            lo = _mm_unpacklo_epi8(l, h);
            hi = _mm_unpackhi_epi8(l, h);
        }
        __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero), mn = _mm512_set1_ps(min);
        a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
        a = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(a, z), s), mn); /* as qtensor.dequantize */
        b = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(b, z), s), mn); /* (x - 0: x, exactly) */
    }
    return (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a: the low 16 features */
}


/* 4-bit codes: the 16 values a (row, group) can take, (code - zero) * scale - min rounded to
   bf16, as a table VPERMW looks 32 codes up in at once (exact: each entry is dequantize's
   value). */
static inline __m512i qa_u4_table(float scale, float zero, float min) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
    v = _mm512_sub_ps(v, _mm512_set1_ps(min));
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

/* 16 bytes of 4-bit codes (feature 2p in byte p's low nibble) -> 16 dwords, dword p holding
   features 2p and 2p + 1 as bf16 from `table`. */
static inline __m512i qa_u4_lookup(const uint8_t* c, __m512i table) {
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
    __m512i idx = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)),
                                   _mm512_set1_epi32(0x000F000F));
    return _mm512_permutexvar_epi16(idx, table);
}

/* Packed panels (QA_P8 / QA_P4; N % 32 == 0): weight rows n0..n0+15, half of a 32-row panel,
   dequantized into wb [K/2][16][2] bf16. A panel's dword holds 4 (8-bit) or 8 (4-bit)
   features of one row and its 16 rows' dwords are one 64-byte line, so the lanes are the
   rows: each feature of the line becomes a vector of the 16 rows' values, (code - zero) *
   scale in fp32 as qa_deq32 computes it, rounded to bf16 by the same instruction (so the
   values of the row-major codes' panel, to the bit), and two features' vectors interleave
   into one row of wb. Group mins (none: 0) stay row-major (common.h's Mins). */
static inline void qa_dequant16_packed(int kind, const uint8_t* codes, const float* scales,
                                       const uint8_t* zeros, const Mins* mins, int64_t n0,
                                       int64_t K, int64_t gs, uint16_t* wb) {
    const int bits = kind == QA_P8 ? 8 : 4, per = 32 / bits; /* features per dword */
    const int64_t G = K / gs, p = n0 / 32, h = (n0 % 32) / 16;
    const uint32_t* P = (const uint32_t*)(codes + p * 32 * K * bits / 8);
    const __m512i pairs = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003,
                                            0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                            0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                            0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
    const __m512i mask = _mm512_set1_epi32(bits == 8 ? 0xFF : 0x0F);
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = (p * G + g) * 32 + 16 * h;
        const __m512 s = _mm512_loadu_ps(scales + at);
        const __m512 z = zeros ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                     _mm_loadu_si128((const __m128i*)(zeros + at))))
                               : _mm512_setzero_ps();
        float mf[16] = {0};
        for (int j = 0; mins && j < 16; j++) mf[j] = min_at(mins, n0 + j, g);
        const __m512 mn = _mm512_loadu_ps(mf);
        for (int64_t q = g * gs / per; q < (g + 1) * gs / per; q++) {
            __m512i d = _mm512_loadu_si512((const void*)(P + q * 32 + 16 * h));
            for (int f = 0; f < per; f += 2) {
                __m512 a =
                    _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, bits * f), mask));
                __m512 b = _mm512_cvtepi32_ps(
                    _mm512_and_si512(_mm512_srli_epi32(d, bits * (f + 1)), mask));
                a = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(a, z), s), mn);
                b = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(b, z), s), mn);
                __m512i v = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
                _mm512_store_si512((__m512i*)(wb + (q * per + f) * 16), v);
            }
        }
    }
}

/* Weight rows n0..n0+15 (past N: zeros) dequantized into wb [K/2][16][2] bf16, a group at a
   time: each row's scale and zero point (or 4-bit table) read once per group. */
static inline __attribute__((always_inline)) void qa_dequant16(
    int kind, const uint8_t* codes, int64_t cstride, const float* scales, const uint8_t* zeros,
    int64_t gstride, const Mins* mins, int64_t n0, int64_t N, int64_t K, int64_t gs,
    uint16_t* wb) {
    if (kind == QA_P8 || kind == QA_P4) {
        qa_dequant16_packed(kind, codes, scales, zeros, mins, n0, K, gs, wb);
        return;
    }
    int live = N - n0 < 16 ? (int)(N - n0) : 16;
    const uint8_t* row[16];
    for (int j = 0; j < 16; j++) row[j] = codes + (n0 + (j < live ? j : 0)) * cstride;
    float sf[16], zf[16], mf[16];
    __m512i tab[16];
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, g++) {
        for (int j = 0; j < live; j++) {
            sf[j] = scales[(n0 + j) * gstride + g];
            zf[j] = kind == QA_FP8 ? 0.0f : (float)zeros[(n0 + j) * gstride + g];
            mf[j] = mins ? min_at(mins, n0 + j, g) : 0.0f;
            if (kind == QA_U4) tab[j] = qa_u4_table(sf[j], zf[j], mf[j]);
        }
        for (int64_t k = g0; k < g0 + gs; k += 32) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                if (j >= live) r[j] = _mm512_setzero_si512();
                else if (kind == QA_U4) r[j] = qa_u4_lookup(row[j] + k / 2, tab[j]);
                else r[j] = qa_deq32(kind, row[j], k, sf[j], zf[j], mf[j]);
            }
            transpose16(r); /* r[p]: feature pair p of the 16 rows */
            for (int p = 0; p < 16; p++)
                _mm512_store_si512((__m512i*)(wb + (k / 2 + p) * 32), r[p]);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

/* C tile (16 input rows x 16 outputs, fp32) in `c` -> y rows m0.., outputs n0.. (bounded). */
static inline void qa_store(const float* c, void* y, int out_bf16, int64_t m0, int64_t rows,
                            int64_t n0, int64_t cols, int64_t N) {
    __mmask16 mask = (__mmask16)((1u << cols) - 1);
    for (int64_t i = 0; i < rows; i++) {
        __m512 v = _mm512_load_ps(c + 16 * i);
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t*)y + (m0 + i) * N + n0, mask,
                                     (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float*)y + (m0 + i) * N + n0, mask, v);
    }
}

/* `count` C tiles in `cbuf` (256 floats apart) -> y: tile t holds input rows m0 + (t >> 1) * 16
   and outputs n0 + (t & 1) * 16 on, bounded by M and N (qa_tile2x2's four, qa_tile1x2's two). */
static inline void qa_store_tiles(const float* cbuf, int count, void* y, int out_bf16,
                                  int64_t m0, int64_t M, int64_t n0, int64_t N) {
    for (int t = 0; t < count; t++) {
        int64_t mm = m0 + (t >> 1) * 16, nn = n0 + (t & 1) * 16;
        int64_t rows = M - mm < 16 ? M - mm : 16, cols = N - nn < 16 ? N - nn : 16;
        if (rows > 0 && cols > 0) qa_store(cbuf + 256 * t, y, out_bf16, mm, rows, nn, cols, N);
    }
}

/* 32 input rows (xa: rows 0-15, xb: 16-31, `ldx` bf16 apart) against 32 weight rows (wb0,
   wb1: dequantized subpanels) over K; the four 16 x 16 results stored into y. */
static inline void qa_tile2x2(const uint16_t* xa, const uint16_t* xb, int64_t ldx,
                              const uint16_t* wb0, const uint16_t* wb1, int64_t K, float* cbuf,
                              void* y, int out_bf16, int64_t m0, int64_t M, int64_t n0,
                              int64_t N) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, xa + k, ldx * 2);
        _tile_loadd(5, xb + k, ldx * 2);
        _tile_loadd(6, wb0 + k * 16, 64);
        _tile_loadd(7, wb1 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
    qa_store_tiles(cbuf, 4, y, out_bf16, m0, M, n0, N);
}

/* At most 16 input rows (a decode batch): one A tile of exactly those rows (the tiles are
   configured with M rows), two weight subpanels, two C tiles; no padding rows multiplied. */
static inline void qa_tile1x2(const uint16_t* x, int64_t M, const uint16_t* wb0,
                              const uint16_t* wb1, int64_t K, float* cbuf, void* y, int out_bf16,
                              int64_t n0, int64_t N) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, x + k, K * 2);
        _tile_loadd(6, wb0 + k * 16, 64);
        _tile_loadd(7, wb1 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    qa_store_tiles(cbuf, 2, y, out_bf16, 0, M, n0, N);
}

static inline __attribute__((always_inline)) void qamx_kind(
    int kind, const uint16_t* x, const uint8_t* codes, int64_t cstride, const float* scales,
    const uint8_t* zeros, int64_t gstride, const Mins* mins, void* y, int out_bf16, int64_t M,
    int64_t N, int64_t K, int64_t gs) {
    /* the last partial block of 32 input rows, zero-padded (A tiles are 16 full rows) */
    int64_t full = M / 32 * 32;
    int small = M <= 16;
    uint16_t* xpad = 0;
    if (full < M && !small) {
        xpad = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 32 * K);
        memset(xpad, 0, sizeof(uint16_t) * 32 * K);
        memcpy(xpad, x + full * K, sizeof(uint16_t) * (M - full) * K);
    }
    /* panel rows: a multiple of 32, within QA_PANEL_BYTES, and enough panels for the threads */
    int threads = omp_get_max_threads();
    int64_t per_thread = ((N + threads - 1) / threads + 31) / 32 * 32;
    int64_t fit = QA_PANEL_BYTES / (2 * K) / 32 * 32;
    int64_t np = per_thread < fit ? per_thread : fit;
    if (np < 32) np = 32;
    int64_t panels = (N + np - 1) / np;
    #pragma omp parallel
    {
        AmxConfig cfg;
        amx_config_init(&cfg);
        for (int t = 0; t < 8; t++) amx_config_tile(&cfg, t, 16, 64);
        if (small) /* C and A tiles of M rows (qa_tile1x2) */
            for (int t = 0; t < 6; t++) amx_config_tile(&cfg, t, (int)M, 64);
        amx_config(&cfg);
        uint16_t* wb = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * np * K);
        float* cbuf = (float*)aligned_alloc(64, sizeof(float) * 4 * 256);
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; q++) {
            int64_t p0 = q * np, rows = N - p0 < np ? (N - p0 + 31) / 32 * 32 : np;
            for (int64_t s = 0; s < rows; s += 16)
                qa_dequant16(kind, codes, cstride, scales, zeros, gstride, mins, p0 + s, N, K,
                             gs, wb + s * K);
            for (int64_t s = 0; small && s < rows; s += 32)
                qa_tile1x2(x, M, wb + s * K, wb + (s + 16) * K, K, cbuf, y, out_bf16, p0 + s, N);
            for (int64_t m0 = 0; !small && m0 < M; m0 += 32) {
                const uint16_t* xa = m0 < full ? x + m0 * K : xpad;
                for (int64_t s = 0; s < rows; s += 32)
                    qa_tile2x2(xa, xa + 16 * K, K, wb + s * K, wb + (s + 16) * K, K, cbuf, y,
                               out_bf16, m0, M, p0 + s, N);
            }
        }
        free(wb);
        free(cbuf);
        amx_release();
    }
    free(xpad);
}

/* 1 where these kernels may run (the tiles granted to this process), else 0. */
int qamx_ready(void) { return amx_ready(); }

#else /* AVX512-BF16 without AMX (AMD Zen 4 and later): the same panel, VDPBF16PS tiles */

/* Without AMX, the panel is multiplied by VDPBF16PS on zmm registers: QB_MR input rows x 32
   weight rows (two subpanels) of fp32 sums held in 2 * QB_MR registers over all of K, each
   step a broadcast pair of x's features against the 16 rows' pairs of a subpanel. Each sum
   adds its pairs in feature order whatever the threads or the rows next to it: the same bits
   at every thread count, the values of the AMX version (a bf16 x bf16 product is exact in
   fp32). The panel (<= QB_PANEL_BYTES) stays in L2 while every block of x passes over it. */
#define QB_MR 12
#define QB_PANEL_BYTES (384 << 10)

static inline __attribute__((always_inline)) void qb_store16(__m512 v, void* y, int out_bf16,
                                                             int64_t row, int64_t n0,
                                                             int64_t cols, int64_t N) {
    if (cols <= 0) return;
    __mmask16 mask = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
    if (out_bf16)
        _mm256_mask_storeu_epi16((uint16_t*)y + row * N + n0, mask,
                                 (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float*)y + row * N + n0, mask, v);
}

/* `mr` (<= QB_MR, a constant where inlined) rows of x, packed as [K/2][QB_MR] feature pairs
   (xp), against subpanels wb0, wb1 ([K/2][16][2] bf16) -> y rows m0.., outputs n0..n0+31
   (bounded by N). */
static inline __attribute__((always_inline)) void qb_tile(int mr, const int32_t* xp,
                                                          const uint16_t* wb0,
                                                          const uint16_t* wb1, int64_t K,
                                                          void* y, int out_bf16, int64_t m0,
                                                          int64_t n0, int64_t N) {
    __m512 a0[QB_MR], a1[QB_MR];
    for (int i = 0; i < mr; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; p++) {
        __m512bh w0 = (__m512bh)_mm512_load_si512((const void*)(wb0 + p * 32));
        __m512bh w1 = (__m512bh)_mm512_load_si512((const void*)(wb1 + p * 32));
        for (int i = 0; i < mr; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[p * QB_MR + i]);
            a0[i] = _mm512_dpbf16_ps(a0[i], xb, w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], xb, w1);
        }
    }
    for (int i = 0; i < mr; i++) {
        qb_store16(a0[i], y, out_bf16, m0 + i, n0, N - n0, N);
        qb_store16(a1[i], y, out_bf16, m0 + i, n0 + 16, N - n0 - 16, N);
    }
}

#define QB_TILE(R)                                                                         \
    case R:                                                                                \
        qb_tile(R, xp, wb0, wb1, K, y, out_bf16, m0, n0, N);                               \
        break;
static void qb_tile_rows(int mr, const int32_t* xp, const uint16_t* wb0, const uint16_t* wb1,
                         int64_t K, void* y, int out_bf16, int64_t m0, int64_t n0, int64_t N) {
    switch (mr) {
        QB_TILE(1) QB_TILE(2) QB_TILE(3) QB_TILE(4) QB_TILE(5) QB_TILE(6)
        QB_TILE(7) QB_TILE(8) QB_TILE(9) QB_TILE(10) QB_TILE(11) QB_TILE(12)
        default: break;
    }
}

static inline __attribute__((always_inline)) void qamx_kind(
    int kind, const uint16_t* x, const uint8_t* codes, int64_t cstride, const float* scales,
    const uint8_t* zeros, int64_t gstride, const Mins* mins, void* y, int out_bf16, int64_t M,
    int64_t N, int64_t K, int64_t gs) {
    /* panel rows: a multiple of 32, within QB_PANEL_BYTES, and about 4 panels a thread,
       handed out as the threads come for them (a thread slowed by other work on its core
       holds the call up for one panel, not for a quarter of N: 2 threads on a loaded Zen 4
       VM took up to 1.3x oneDNN's time with a static split) */
    int threads = omp_get_max_threads();
    int64_t per_thread = ((N + 4 * threads - 1) / (4 * threads) + 31) / 32 * 32;
    int64_t fit = QB_PANEL_BYTES / (2 * K) / 32 * 32;
    int64_t np = per_thread < fit ? per_thread : fit;
    if (np < 32) np = 32;
    int64_t panels = (N + np - 1) / np;
    /* x in blocks of QB_MR rows, each as [K/2][QB_MR] feature pairs (rows past M: zeros), so
       that a tile's broadcasts read one short run per step from one pointer */
    int64_t blocks = (M + QB_MR - 1) / QB_MR;
    int32_t* xp = (int32_t*)aligned_alloc(64, sizeof(int32_t) * blocks * QB_MR * (K / 2));
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int32_t* dst = xp + b * QB_MR * (K / 2);
            for (int i = 0; i < QB_MR; i++) {
                int64_t m = b * QB_MR + i;
                const int32_t* src = (const int32_t*)(x + m * K);
                if (m < M)
                    for (int64_t p = 0; p < K / 2; p++) dst[p * QB_MR + i] = src[p];
                else
                    for (int64_t p = 0; p < K / 2; p++) dst[p * QB_MR + i] = 0;
            }
        }
        uint16_t* wb = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * np * K);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < panels; q++) {
            int64_t p0 = q * np, rows = N - p0 < np ? (N - p0 + 31) / 32 * 32 : np;
            for (int64_t s = 0; s < rows; s += 16)
                qa_dequant16(kind, codes, cstride, scales, zeros, gstride, mins, p0 + s, N, K,
                             gs, wb + s * K);
            for (int64_t m0 = 0; m0 < M; m0 += QB_MR) {
                int mr = M - m0 < QB_MR ? (int)(M - m0) : QB_MR;
                for (int64_t s = 0; s < rows; s += 32)
                    qb_tile_rows(mr, xp + m0 * (K / 2), wb + s * K, wb + (s + 16) * K, K, y,
                                 out_bf16, m0, p0 + s, N);
            }
        }
        free(wb);
    }
    free(xp);
}

/* 1: nothing to ask the OS for (zmm registers only). */
int qamx_ready(void) { return 1; }

#endif /* AMX tiles, or AVX512-BF16 only */

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (bf16 only: x_bf16 must be 1) @ W.T; the
   arguments are qgemv.c's. NAME_mins: the same with each group's min folded into the panel's
   values, for integer codes: mins [N, G] fp32 (mscale null), or u8 m with fp32 dmin mscale
   [N, G / per] (common.h's Mins; row strides mstride and sstride). */
#define QAMX(NAME, KIND)                                                                      \
    void NAME(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,             \
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y,          \
              int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {                   \
        (void)x_bf16;                                                                       \
        qamx_kind(KIND, (const uint16_t*)x, codes, cstride, scales, zeros, gstride, 0, y,    \
                  out_bf16, M, N, K, gs);                                                   \
    }
#define QAMX_MINS(NAME, KIND)                                                                 \
    void NAME(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,             \
              const float* scales, const uint8_t* zeros, int64_t gstride, const void* mins,  \
              int64_t mstride, const float* mscale, int64_t sstride, int64_t per, void* y,   \
              int out_bf16, int64_t M, int64_t N, int64_t K, int64_t gs) {                   \
        (void)x_bf16;                                                                       \
        const Mins m = mins_of(mins, mstride, mscale, sstride, per);                        \
        qamx_kind(KIND, (const uint16_t*)x, codes, cstride, scales, zeros, gstride, &m, y,   \
                  out_bf16, M, N, K, gs);                                                   \
    }
QAMX(qamx_u8, QA_U8)
QAMX(qamx_u4, QA_U4)
QAMX(qamx_fp8, QA_FP8)
QAMX(qamx_p8, QA_P8)
QAMX(qamx_p4, QA_P4)
QAMX_MINS(qamx_mins_u8, QA_U8)
QAMX_MINS(qamx_mins_u4, QA_U4)
QAMX_MINS(qamx_mins_p8, QA_P8)
QAMX_MINS(qamx_mins_p4, QA_P4)

#else
typedef int qamx_not_built; /* no AMX in this build: no entry points (cpu_kernels.py) */
#endif
