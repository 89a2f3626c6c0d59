/* Few rows (decode) over integer-coded quantized weights on AMX-INT8 tiles, straight from the
   codes: y[M, N] = x[M, K] @ W.T with W as minisgl/quant/qtensor.py holds it (u8 codes, or
   4-bit codes two to a byte, per-row per-group scales and zero points).

   The decode GEMV (qgemv.c) widens each code to int16 and multiplies with VPDPWSSD: from two
   input rows on it is bound by those multiplies, each extra row re-doing them per weight
   byte, so 8 rows cost ~2.3-2.9x one row (and more than bf16's AMX at 8 rows). Here one tile
   dot product TDPBUSD multiplies 16 weight rows x 64 codes by 64 features of up to 16 input
   rows, so a weight byte costs the same work for 1 or 16 rows and the step stays bound by
   streaming the codes:

     y[m, n] = xscale[m] * sum_g scale[n, g] * (sum_{k in g} code[n, k] * xq[m, k]
                                                - zero[n, g] * sum_{k in g} xq[m, k])

   with x quantized per row to int16 exactly as qgemv.c does (scale max|x| / 32767, nearest
   integer). AMX multiplies bytes, so xq = 256 * hi + lo with hi = xq >> 8 (signed) and
   lo = xq & 255 (unsigned): two B tiles, TDPBUSD (u8 codes x s8 hi) and TDPBUUD (u8 x u8 lo),
   their int32 sums exact; 256 * hi_sum + lo_sum is exact in int32 over at most CHUNK features
   (255 * 32767 * 128 < 2^31) and becomes fp32 once per chunk, times the group's scale.

   Operands (C^T = W . x^T, as amx.c): A = 16 weight rows x S codes (S = 64, or 32 for groups
   of 32), for 8-bit codes loaded straight from the row-major codes (no copy); 4-bit codes are
   split into bytes in an L1/L2 buffer (2 ops per 64 codes: low nibbles = the even features,
   high nibbles = the odd ones, so x is laid out per step in that order). B = x^T in the VNNI
   layout (row kq: 4 consecutive features of each input row), packed per call; its columns are
   the input rows, configured to exactly M (<= 16) so no padding rows are multiplied. C = 16
   weight rows x the input rows, int32.

   A thread's item is 32 weight rows (two A tiles; 4 C + 2 A + 2 B = the 8 tiles), the next
   item prefetched into L2 across the current one's steps, items shared as amx.c shares them.
   Measured (Xeon, Sapphire Rapids class under KVM, amx_int8; one thread, cold weights, CPU
   time, interleaved with qgemv): 8-bit codes at 8 rows 0.60x qgemv's time at 6144x1024 and
   1024x3072, 1.0-1.1x qgemv's own 1-row time; at 1 row 0.93-1.0x qgemv. 4-bit codes at 8
   rows 0.55x qgemv, but 1.6x its 1-row time: the tile products and the folds per group bound
   them, not the bytes. The chooser (cpu_choice.py) picks per row count.

   Compiled where the build targets AMX-TILE and AMX-INT8 (cpu_build.py); the entry points
   exist only there and run only after amx_ready() (amx.h) granted the tiles. */
#include "common.h"
#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)

#include <string.h>

#define QI_ROWS 32   /* weight rows per item: two A tiles */
#define QI_CHUNK 128 /* features whose integer sums combine exactly in int32 */

/* Items ahead the prefetch runs (1, 2 and 3 measured alike: 3072x1024, 1 and 8 rows). */
#define QI_AHEAD 1

/* One call's shape and x, prepared once for every thread. */
typedef struct {
    int bits;        /* 8 or 4 */
    int64_t S;       /* features per tile step */
    int64_t M, N, K, gs, G;
    int64_t cstride; /* bytes between rows of codes */
    int64_t gstride; /* elements between rows of scales / zero points */
    const uint8_t* codes;
    const float* scales;
    const uint8_t* zeros;
    uint8_t* xb;   /* [mtiles][K / S][2][S / 4][64]: hi and lo B tiles per step */
    float* xscale; /* [M] */
    float* xsum;   /* [mtiles][G][16]: per group, integer sums of xq, lanes = input rows */
    int64_t chunks;
    int64_t* chunk; /* [chunks + 1]: chunk i is features [chunk[i], chunk[i + 1]), one group */
} QiCall;

/* 32 int16 of a step (positions p0 .. p0 + 31 of its layout) -> their high bytes (signed)
   into the hi B tile and low bytes into the lo one: position p is byte p % 4 of row p / 4's
   4-byte group of this input row (`lane`). */
static inline void qi_scatter32(__m512i v, int64_t p0, int64_t lane, uint8_t* hi, uint8_t* lo) {
    const __m256i rows = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    __m256i h = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8));
    __m256i l = _mm512_cvtepi16_epi8(v); /* truncates: the low byte */
    int64_t at = (p0 / 4) * 64 + lane * 4;
    _mm256_i32scatter_epi32((int*)(hi + at), rows, h, 1);
    _mm256_i32scatter_epi32((int*)(lo + at), rows, l, 1);
}

/* x row m -> its int16 codes (qgemv.c's quantize_x: round to nearest even, clamp to
   +-32767), its scale, its group sums, and its bytes into the B tiles, in each step's layout:
   8-bit codes in feature order, 4-bit ones low nibbles (the even features) first, then high
   nibbles (the odd ones). */
static void qi_prepare_row(QiCall* c, const void* x, int x_bf16, int64_t m, int16_t* tmp) {
    const int64_t K = c->K, S = c->S;
    const float* xf = (const float*)x + m * K;
    const uint16_t* xh = (const uint16_t*)x + m * K;
#define QI_LOADX(k)                                                                           \
    (x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(                                         \
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xh + (k)))), 16)) \
            : _mm512_loadu_ps(xf + (k)))
    __m512 amax16 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(QI_LOADX(k)));
    float amax = _mm512_reduce_max_ps(amax16);
    float s = amax > 0 ? amax / 32767.0f : 1.0f;
    c->xscale[m] = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
    int64_t mt = m / 16, lane = m % 16, steps = K / S;
    for (int64_t g = 0; g < c->G; g++) {
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = g * c->gs; k < (g + 1) * c->gs; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(QI_LOADX(k), inv));
            q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
            sum = _mm512_add_epi32(sum, q);
            _mm256_storeu_si256((__m256i*)(tmp + k), _mm512_cvtepi32_epi16(q));
        }
        c->xsum[(mt * c->G + g) * 16 + lane] = (float)_mm512_reduce_add_epi32(sum);
    }
#undef QI_LOADX
    /* 4-bit layouts: evens then odds of 64 (two vectors) or of 32 (one) */
    const __m512i even = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000A0008, 0x000E000C,
                                           0x00120010, 0x00160014, 0x001A0018, 0x001E001C,
                                           0x00220020, 0x00260024, 0x002A0028, 0x002E002C,
                                           0x00320030, 0x00360034, 0x003A0038, 0x003E003C);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    const __m512i half = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000A0008, 0x000E000C,
                                           0x00120010, 0x00160014, 0x001A0018, 0x001E001C,
                                           0x00030001, 0x00070005, 0x000B0009, 0x000F000D,
                                           0x00130011, 0x00170015, 0x001B0019, 0x001F001D);
    for (int64_t t = 0; t < steps; t++) {
        uint8_t* hi = c->xb + ((mt * steps + t) * 2) * (S / 4) * 64;
        uint8_t* lo = hi + (S / 4) * 64;
        const int16_t* q = tmp + t * S;
        if (S == 64) {
            __m512i a = _mm512_loadu_si512((const void*)q), b = _mm512_loadu_si512((const void*)(q + 32));
            if (c->bits == 4) {
                __m512i e = _mm512_permutex2var_epi16(a, even, b);
                b = _mm512_permutex2var_epi16(a, odd, b);
                a = e;
            }
            qi_scatter32(a, 0, lane, hi, lo);
            qi_scatter32(b, 32, lane, hi, lo);
        } else {
            __m512i a = _mm512_loadu_si512((const void*)q);
            if (c->bits == 4) a = _mm512_permutexvar_epi16(half, a);
            qi_scatter32(a, 0, lane, hi, lo);
        }
    }
}

/* Issues `lines` cache lines of the next item (rows of `row_lines` lines, `stride` bytes
   apart) evenly over `steps` calls of qi_prefetch. */
typedef struct {
    const char* base;
    int64_t stride, row_lines, lines, steps, credit, row, col;
} QiAhead;

static inline void qi_prefetch(QiAhead* p) {
    if (!p->base) return;
    for (p->credit += p->lines; p->credit >= p->steps; p->credit -= p->steps) {
        _mm_prefetch(p->base + p->row * p->stride + 64 * p->col, _MM_HINT_T1);
        if (++p->col == p->row_lines) p->col = 0, p->row++;
    }
}

/* 32 rows of 4-bit codes for one step (S features: S / 2 bytes per row from `src`) -> two A
   tiles in `dst` [32][S] u8, low nibbles then high nibbles per row. */
static inline void qi_split_u4(const uint8_t* src, int64_t cstride, int64_t S, uint8_t* dst) {
    if (S == 64) {
        const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int r = 0; r < QI_ROWS; r++) {
            __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(src + r * cstride)));
            v = _mm512_and_si512(_mm512_srlv_epi64(v, shift), mask);
            _mm512_store_si512((__m512i*)(dst + r * 64), v);
        }
    } else {
        const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0);
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int r = 0; r < QI_ROWS; r++) {
            __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(src + r * cstride)));
            v = _mm256_and_si256(_mm256_srlv_epi64(v, shift), mask);
            _mm256_store_si256((__m256i*)(dst + r * 32), v);
        }
    }
}

/* A chunk's int32 sums (4 C tiles in `cb`) folded into acc: times the group's scale, and at
   the group's end its zero point times x's group sums. acc[16 r + m]: weight row r, input
   row m. */
static inline void qi_fold(const QiCall* c, const int32_t* cb, int64_t n0, int64_t rows,
                           int64_t mt, int64_t g, int last, float* acc) {
    const __m512 xs = _mm512_load_ps(c->xsum + (mt * c->G + g) * 16);
    for (int64_t r = 0; r < rows; r++) {
        const int32_t* h = cb + (r / 16) * 512 + (r % 16) * 16;
        __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(h), 8),
                                     _mm512_load_si512(h + 256));
        __m512 t = _mm512_cvtepi32_ps(v);
        if (last && c->zeros)
            t = _mm512_fnmadd_ps(_mm512_set1_ps((float)c->zeros[(n0 + r) * c->gstride + g]), xs, t);
        __m512 s = _mm512_set1_ps(c->scales[(n0 + r) * c->gstride + g]);
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(t, s, _mm512_load_ps(acc + 16 * r)));
    }
}

/* The same for at most 8 input rows, whose C tiles were stored two to a 64-byte line (rows
   r and r + 16 of the item side by side, qi_store_tiles): one vector per two weight rows.
   acc[16 p + m]: weight row p, input row m; acc[16 p + 8 + m]: weight row p + 16. */
static inline void qi_fold2(const QiCall* c, const int32_t* cb, int64_t n0, int64_t rows,
                            int64_t mt, int64_t g, int last, float* acc) {
    const __m512 xs = _mm512_load_ps(c->xsum + (mt * c->G + g) * 16);
    const __m512 xs2 = _mm512_shuffle_f32x4(xs, xs, 0x44); /* input rows 0-7, twice */
    const int64_t pairs = rows < 16 ? rows : 16;
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t* h = cb + p * 16;
        __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(h), 8),
                                     _mm512_load_si512(h + 256));
        __m512 t = _mm512_cvtepi32_ps(v);
        int64_t a = (n0 + p) * c->gstride + g, b = (n0 + p + 16) * c->gstride + g;
        int two = p + 16 < rows; /* row p + 16 exists */
        if (last && c->zeros) {
            __m512 z = _mm512_mask_mov_ps(_mm512_set1_ps((float)c->zeros[a]), 0xFF00,
                                          _mm512_set1_ps(two ? (float)c->zeros[b] : 0.0f));
            t = _mm512_fnmadd_ps(z, xs2, t);
        }
        __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(c->scales[a]), 0xFF00,
                                      _mm512_set1_ps(two ? c->scales[b] : 0.0f));
        _mm512_store_ps(acc + 16 * p, _mm512_fmadd_ps(t, s, _mm512_load_ps(acc + 16 * p)));
    }
}

/* Chunks' sums are folded QI_LAG chunks after their tiles were stored, and 4-bit codes split
   QI_LAG chunks before their tiles load them: a load of lines still in the store buffer waits
   for them to reach the cache, whether a vector load after a tile store or a tile load after
   vector stores (measured: folding right after the store and splitting right before the
   loads ran at a quarter to a seventh of this rate). */
#define QI_LAG 2

/* 4-bit codes of chunk i (its steps) split into ubuf. */
static inline void qi_split_chunk(const QiCall* c, const uint8_t* a, int64_t astride,
                                  uint8_t* ubuf, int64_t i) {
    const int64_t S = c->S;
    for (int64_t k = c->chunk[i]; k < c->chunk[i + 1]; k += S)
        qi_split_u4(a + k / 2, astride, S, ubuf + (k / S) * QI_ROWS * S);
}

/* One item (weight rows n0.., `a` the first row's codes, `astride` between rows) against
   m-tile mt (input rows 16 mt ..): y for those rows. `ubuf` [K / S][32][S]: the 4-bit codes as
   bytes, split in the first pass (`split`) and read back in later ones. `cbuf`: QI_LAG + 1
   chunks' 4 C tiles. */
static void qi_item_pass(const QiCall* c, const uint8_t* a, int64_t astride, int64_t n0,
                         int64_t mt, int split, uint8_t* ubuf, QiAhead* pf, int32_t* cbuf,
                         float* acc, void* y, int out_bf16) {
    const int64_t S = c->S, steps = c->K / S, chunks = c->chunks;
    const int64_t rows = c->N - n0 < QI_ROWS ? c->N - n0 : QI_ROWS;
    const int64_t m0 = mt * 16, mrows = c->M - m0 < 16 ? c->M - m0 : 16;
    const uint8_t* xt = c->xb + mt * steps * 2 * (S / 4) * 64;
    const int64_t tb = (S / 4) * 64; /* bytes per B tile */
    const int u4 = c->bits == 4 && split;
    const int paired = c->M <= 8;
    for (int r = 0; r < QI_ROWS; r++) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t i = 0; u4 && i < QI_LAG && i < chunks; i++) qi_split_chunk(c, a, astride, ubuf, i);
    for (int64_t i = 0; i < chunks + QI_LAG; i++) {
        if (i < chunks) {
            if (u4 && i + QI_LAG < chunks) qi_split_chunk(c, a, astride, ubuf, i + QI_LAG);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = c->chunk[i]; k < c->chunk[i + 1]; k += S) {
                int64_t t = k / S;
                if (c->bits == 8) {
                    _tile_loadd(4, a + k, astride);
                    _tile_loadd(5, a + 16 * astride + k, astride);
                } else {
                    const uint8_t* u = ubuf + t * QI_ROWS * S;
                    _tile_loadd(4, u, S);
                    _tile_loadd(5, u + 16 * S, S);
                }
                _tile_loadd(6, xt + 2 * t * tb, 64);
                _tile_loadd(7, xt + (2 * t + 1) * tb, 64);
                _tile_dpbusd(0, 4, 6);
                _tile_dpbuud(1, 4, 7);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbuud(3, 5, 7);
                qi_prefetch(pf);
            }
            int32_t* cb = cbuf + (i % (QI_LAG + 1)) * 1024;
            if (paired) { /* C tiles of <= 8 columns: rows r and r + 16 share a line */
                _tile_stored(0, cb, 64);
                _tile_stored(2, cb + 8, 64);
                _tile_stored(1, cb + 256, 64);
                _tile_stored(3, cb + 256 + 8, 64);
            } else {
                _tile_stored(0, cb, 64);
                _tile_stored(1, cb + 256, 64);
                _tile_stored(2, cb + 512, 64);
                _tile_stored(3, cb + 768, 64);
            }
        }
        int64_t j = i - QI_LAG;
        if (j >= 0 && paired)
            qi_fold2(c, cbuf + (j % (QI_LAG + 1)) * 1024, n0, rows, mt, c->chunk[j] / c->gs,
                     c->chunk[j + 1] % c->gs == 0, acc);
        else if (j >= 0)
            qi_fold(c, cbuf + (j % (QI_LAG + 1)) * 1024, n0, rows, mt, c->chunk[j] / c->gs,
                    c->chunk[j + 1] % c->gs == 0, acc);
    }
    for (int64_t i = 0; i < mrows; i++) {
        float f = c->xscale[m0 + i];
        for (int64_t r = 0; r < rows; r++) {
            float v = paired ? acc[16 * (r % 16) + 8 * (r / 16) + i] : acc[16 * r + i];
            store(y, (m0 + i) * c->N + n0 + r, v * f, out_bf16);
        }
    }
}

/* The tiles for this call: C 16 weight rows x (input rows) int32, A 16 rows x S codes, B
   S / 4 rows x (input rows) 4-byte groups. */
static void qi_config(int64_t S, int64_t cols) {
    AmxConfig cfg;
    amx_config_init(&cfg);
    for (int t = 0; t < 4; t++) amx_config_tile(&cfg, t, 16, (int)(4 * cols));
    amx_config_tile(&cfg, 4, 16, (int)S);
    amx_config_tile(&cfg, 5, 16, (int)S);
    amx_config_tile(&cfg, 6, (int)(S / 4), (int)(4 * cols));
    amx_config_tile(&cfg, 7, (int)(S / 4), (int)(4 * cols));
    amx_config(&cfg);
}

static void qamxi_kind(int bits, const void* x, int x_bf16, const uint8_t* codes,
                       int64_t cstride, const float* scales, const uint8_t* zeros,
                       int64_t gstride, void* y, int out_bf16, int64_t M, int64_t N, int64_t K,
                       int64_t gs) {
    QiCall c = {bits, gs % 64 == 0 ? 64 : 32, M, N, K, gs, K / gs, cstride, gstride, codes,
                scales, zeros, NULL, NULL, NULL, 0, NULL};
    /* chunks: at most QI_CHUNK features, never across a group */
    c.chunk = (int64_t*)malloc(sizeof(int64_t) * (K / 32 + 2));
    c.chunk[0] = 0;
    for (int64_t k = 0; k < K;) {
        int64_t gend = (k / gs + 1) * gs;
        k = gend < k + QI_CHUNK ? gend : k + QI_CHUNK;
        c.chunk[++c.chunks] = k;
    }
    int64_t mtiles = (M + 15) / 16, steps = K / c.S;
    /* B tiles' columns past M (the last m-tile's) are never read where M <= 16 (the tiles
       are configured with M columns); beyond, they are multiplied and their sums dropped */
    c.xb = (uint8_t*)aligned_alloc(64, (size_t)(mtiles * steps * 2 * (c.S / 4) * 64));
    c.xscale = (float*)malloc(sizeof(float) * M);
    /* zeros in the lanes of absent input rows: garbage there could be subnormal, and every
       multiply-add on a subnormal takes a microcode assist */
    c.xsum = (float*)aligned_alloc(64, sizeof(float) * mtiles * c.G * 16);
    memset(c.xsum, 0, sizeof(float) * mtiles * c.G * 16);
    int64_t items = (N + QI_ROWS - 1) / QI_ROWS;
    int64_t row_bytes = bits == 8 ? K : K / 2;
    Share shares[SHARE_MAX];
    int parts = share_parts();
    shares_init(shares, parts, items);
    #pragma omp parallel
    {
        int16_t* tmp = (int16_t*)malloc(sizeof(int16_t) * K);
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) qi_prepare_row(&c, x, x_bf16, m, tmp);
        free(tmp);
        qi_config(c.S, M < 16 ? M : 16);
        int32_t* cbuf = (int32_t*)aligned_alloc(64, sizeof(int32_t) * (QI_LAG + 1) * 1024);
        memset(cbuf, 0, sizeof(int32_t) * (QI_LAG + 1) * 1024); /* lanes past M: never stored */
        float* acc = (float*)aligned_alloc(64, sizeof(float) * QI_ROWS * 16);
        uint8_t* ubuf = bits == 4 ? (uint8_t*)aligned_alloc(64, (size_t)(QI_ROWS * K)) : NULL;
        uint8_t* pad = NULL; /* a last, short item's codes, zero-padded to 32 rows */
        int64_t expect = -1;
        for (int64_t q; (q = share_next(shares, parts, omp_get_thread_num())) >= 0;) {
            int64_t n0 = q * QI_ROWS;
            const uint8_t* a = codes + n0 * cstride;
            int64_t astride = cstride;
            if (N - n0 < QI_ROWS) {
                if (!pad) pad = (uint8_t*)aligned_alloc(64, (size_t)(QI_ROWS * row_bytes));
                memset(pad, 0, (size_t)(QI_ROWS * row_bytes));
                for (int64_t r = 0; r < N - n0; r++)
                    memcpy(pad + r * row_bytes, a + r * cstride, (size_t)row_bytes);
                a = pad, astride = row_bytes;
            } else if (q != expect) { /* not the items prefetched: fetch them all now */
                for (int64_t i = 0; i < QI_AHEAD && q + i < items && N - (n0 + i * QI_ROWS) >= QI_ROWS; i++)
                    for (int64_t r = 0; r < QI_ROWS; r++)
                        for (int64_t l = 0; l < row_bytes; l += 64)
                            _mm_prefetch((const char*)a + (i * QI_ROWS + r) * cstride + l, _MM_HINT_T1);
            }
            int64_t nq = q + QI_AHEAD;
            int next_full = nq < items && N - nq * QI_ROWS >= QI_ROWS;
            int64_t row_lines = (row_bytes + 63) / 64;
            QiAhead pf = {next_full ? (const char*)(codes + nq * QI_ROWS * cstride) : NULL,
                          cstride, row_lines, QI_ROWS * row_lines, mtiles * steps, 0, 0, 0};
            for (int64_t mt = 0; mt < mtiles; mt++)
                qi_item_pass(&c, a, astride, n0, mt, mt == 0, ubuf, &pf, cbuf, acc, y, out_bf16);
            expect = q + 1;
        }
        amx_release();
        free(pad);
        free(ubuf);
        free(acc);
        free(cbuf);
    }
    free(c.xb);
    free(c.xscale);
    free(c.xsum);
    free(c.chunk);
}

/* 1 where these kernels may run (the tiles granted to this process), else 0. */
int qamxi_ready(void) { return amx_ready(); }

/* y[M, N] (fp32, or bf16 where out_bf16) = x[M, K] (fp32, or bf16 where x_bf16) @ W.T; the
   arguments are qgemv.c's (gs % 32 == 0, K % gs == 0). */
void qamxi_u8(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
              int64_t M, int64_t N, int64_t K, int64_t gs) {
    qamxi_kind(8, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N, K, gs);
}
void qamxi_u4(const void* x, int x_bf16, const uint8_t* codes, int64_t cstride,
              const float* scales, const uint8_t* zeros, int64_t gstride, void* y, int out_bf16,
              int64_t M, int64_t N, int64_t K, int64_t gs) {
    qamxi_kind(4, x, x_bf16, codes, cstride, scales, zeros, gstride, y, out_bf16, M, N, K, gs);
}

#else
typedef int qamxi_not_built; /* no AMX-INT8 in this build: no entry points (cpu_kernels.py) */
#endif
