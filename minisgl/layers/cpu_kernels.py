"""Two small AVX2 kernels for CPU decode, where eager PyTorch leaves most of the time on the table.

- gemv: y[M, N] = x[M, K] @ W[N, K].T for small M. Decode streams every weight once per step,
  so its speed is memory bandwidth; on CPUs without AVX-512, torch's bf16 path (and oneDNN's,
  which refuses bf16 there) reads weights at a fraction of it. The kernel converts bf16 to fp32
  with a shift, accumulates in fp32 with FMAs, keeps four weight rows times two input rows in
  registers, and splits output rows across threads.
- decode attention: one query per request straight over the paged pool (slot indices, no
  gather copy), scores/softmax/weighted sum in fp32. torch's CPU SDPA spends ~0.5 ms per call
  on a single query, more than the layer's matmuls.
Both use torch's own OpenMP threads (they link the libgomp torch already loaded).

Built once with the system C compiler into a per-user cache and loaded with ctypes; anything
missing (no compiler, no AVX2, MINISGL_CPU_KERNELS=0) means `load()` returns None and callers
keep their PyTorch path. Results match F.linear to fp32 rounding (the summation order differs).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MAX_ROWS = 16  # beyond this many input rows the matmul is compute-bound: torch does better

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdlib.h>

static inline __m256 load_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void store(void* y, int64_t i, float v, int out_bf16) {
    if (out_bf16) {
        uint32_t b;
        __builtin_memcpy(&b, &v, 4);
        b += 0x7FFF + ((b >> 16) & 1); /* round to nearest even */
        ((uint16_t*)y)[i] = (uint16_t)(b >> 16);
    } else {
        ((float*)y)[i] = v;
    }
}

/* Four weight rows against one or two input rows; K % 8 == 0. */
#define GEMV(NAME, WT, LOAD)                                                                  \
void NAME(const float* x, const WT* w, void* y, int64_t M, int64_t N, int64_t K,            \
          int out_bf16) {                                                                   \
    int64_t blocks = (N + 3) / 4;                                                           \
    _Pragma("omp parallel for schedule(static)")                                            \
    for (int64_t b = 0; b < blocks; b++) {                                                  \
        int64_t n0 = b * 4;                                                                 \
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;                                          \
        const WT* w0 = w + n0 * K;                                                          \
        const WT* w1 = rows > 1 ? w0 + K : w0;                                              \
        const WT* w2 = rows > 2 ? w0 + 2 * K : w0;                                          \
        const WT* w3 = rows > 3 ? w0 + 3 * K : w0;                                          \
        for (int64_t m = 0; m < M; m += 2) {                                                \
            const float* x0 = x + m * K;                                                    \
            float r[2][4];                                                                  \
            if (m + 1 < M) {                                                                \
                const float* x1 = x0 + K;                                                   \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                  \
                for (int64_t k = 0; k < K; k += 8) {                                        \
                    __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);        \
                    __m256 c0 = LOAD(w0 + k), c1 = LOAD(w1 + k);                            \
                    __m256 c2 = LOAD(w2 + k), c3 = LOAD(w3 + k);                            \
                    a0 = _mm256_fmadd_ps(c0, u, a0); b0 = _mm256_fmadd_ps(c0, v, b0);       \
                    a1 = _mm256_fmadd_ps(c1, u, a1); b1 = _mm256_fmadd_ps(c1, v, b1);       \
                    a2 = _mm256_fmadd_ps(c2, u, a2); b2 = _mm256_fmadd_ps(c2, v, b2);       \
                    a3 = _mm256_fmadd_ps(c3, u, a3); b3 = _mm256_fmadd_ps(c3, v, b3);       \
                }                                                                           \
                r[0][0] = hsum(a0); r[0][1] = hsum(a1); r[0][2] = hsum(a2);                 \
                r[0][3] = hsum(a3); r[1][0] = hsum(b0); r[1][1] = hsum(b1);                 \
                r[1][2] = hsum(b2); r[1][3] = hsum(b3);                                     \
            } else {                                                                        \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
                for (int64_t k = 0; k < K; k += 8) {                                        \
                    __m256 u = _mm256_loadu_ps(x0 + k);                                     \
                    a0 = _mm256_fmadd_ps(LOAD(w0 + k), u, a0);                              \
                    a1 = _mm256_fmadd_ps(LOAD(w1 + k), u, a1);                              \
                    a2 = _mm256_fmadd_ps(LOAD(w2 + k), u, a2);                              \
                    a3 = _mm256_fmadd_ps(LOAD(w3 + k), u, a3);                              \
                }                                                                           \
                r[0][0] = hsum(a0); r[0][1] = hsum(a1);                                     \
                r[0][2] = hsum(a2); r[0][3] = hsum(a3);                                     \
            }                                                                               \
            for (int i = 0; i < 2 && m + i < M; i++)                                        \
                for (int j = 0; j < rows; j++)                                              \
                    store(y, (m + i) * N + n0 + j, r[i][j], out_bf16);                      \
        }                                                                                   \
    }                                                                                       \
}

GEMV(gemv_f32, float, load_f32)

/* bf16 weights: 16 at a time with one load, no shuffle: a 32-bit lane holds two bf16; shifting
   left by 16 gives the even element as fp32, masking the low half gives the odd one. x is
   pre-split into even/odd halves per 16-block to match. K % 16 == 0. */
void gemv_bf16(const float* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
               int out_bf16) {
    float* xs = (float*)malloc(sizeof(float) * M * K);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)
            for (int j = 0; j < 8; j++) {
                xs[m * K + k + j] = x[m * K + k + 2 * j];
                xs[m * K + k + 8 + j] = x[m * K + k + 2 * j + 1];
            }
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    int64_t blocks = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * 4;
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        const uint16_t* wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (n0 + (j < rows ? j : 0)) * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = xs + m * K;
            __m256 a[4], c[4];
            for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m256 xe = _mm256_loadu_ps(xm + k), xo = _mm256_loadu_ps(xm + k + 8);
                for (int j = 0; j < 4; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i*)(wr[j] + k));
                    __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                    a[j] = _mm256_fmadd_ps(we, xe, a[j]);
                    c[j] = _mm256_fmadd_ps(wo, xo, c[j]);
                }
            }
            for (int j = 0; j < rows; j++)
                store(y, m * N + n0 + j, hsum(_mm256_add_ps(a[j], c[j])), out_bf16);
        }
    }
    free(xs);
}

/* q [B, Hq, D] fp32; k/v pool [S, Hkv, D]; slots [B, kmax]; lens [B]; out [B, Hq, D] fp32.
   Query head h reads KV head h / (Hq / Hkv). D % 8 == 0. */
#define ATTN(NAME, KT, LOAD)                                                                  \
void NAME(const float* q, const KT* kp, const KT* vp, const int64_t* slots,                  \
          const int64_t* lens, int64_t kmax, float* out, int64_t B, int64_t Hq,             \
          int64_t Hkv, int64_t D, float scale) {                                            \
    int64_t group = Hq / Hkv;                                                               \
    _Pragma("omp parallel for schedule(dynamic)")                                           \
    for (int64_t task = 0; task < B * Hkv; task++) {                                        \
        int64_t b = task / Hkv, hk = task % Hkv, n = lens[b];                               \
        const int64_t* sl = slots + b * kmax;                                               \
        float* sc = (float*)malloc(sizeof(float) * n);                                      \
        for (int64_t g = 0; g < group; g++) {                                               \
            int64_t h = hk * group + g;                                                     \
            const float* qh = q + (b * Hq + h) * D;                                         \
            float mx = -INFINITY;                                                           \
            for (int64_t i = 0; i < n; i++) {                                               \
                const KT* kr = kp + (sl[i] * Hkv + hk) * D;                                 \
                __m256 a = _mm256_setzero_ps();                                             \
                for (int64_t d = 0; d < D; d += 8)                                          \
                    a = _mm256_fmadd_ps(LOAD(kr + d), _mm256_loadu_ps(qh + d), a);          \
                sc[i] = hsum(a) * scale;                                                    \
                if (sc[i] > mx) mx = sc[i];                                                 \
            }                                                                               \
            float total = 0.f;                                                              \
            for (int64_t i = 0; i < n; i++) { sc[i] = expf(sc[i] - mx); total += sc[i]; }   \
            float* o = out + (b * Hq + h) * D;                                              \
            for (int64_t d = 0; d < D; d += 8) {                                            \
                __m256 acc = _mm256_setzero_ps();                                           \
                for (int64_t i = 0; i < n; i++)                                             \
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[i]),                            \
                                          LOAD(vp + (sl[i] * Hkv + hk) * D + d), acc);      \
                _mm256_storeu_ps(o + d, _mm256_mul_ps(acc, _mm256_set1_ps(1.f / total)));   \
            }                                                                               \
        }                                                                                   \
        free(sc);                                                                           \
    }                                                                                       \
}

ATTN(decode_attn_bf16, uint16_t, load_bf16)
ATTN(decode_attn_f32, float, load_f32)

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

/* RMSNorm over rows of D (row i of x: token i / x_group at x_stride apart, head i % x_group),
   weight row (i % w_rows), with an
   optional residual add first (res_out = x + res_in, normalising that). Rounds where torch's
   eager ops in the model dtype round, so results match the PyTorch path. */
#define RMSNORM(NAME, T, TO_F, ROUND, FROM_F)                                                 \
void NAME(const T* x, int64_t x_group, int64_t x_stride, const T* res_in, T* res_out,       \
          const T* w,                                                                       \
          int64_t w_rows, T* out, int64_t M, int64_t D, float eps) {                        \
    _Pragma("omp parallel for schedule(static) if (M * D > 65536)")                         \
    for (int64_t i = 0; i < M; i++) {                                                       \
        const T* xr = x + (i / x_group) * x_stride + (i % x_group) * D;                     \
        const T* wr = w + (i % w_rows) * D;                                                 \
        T* o = out + i * D;                                                                 \
        float ss = 0.f;                                                                     \
        if (res_in) {                                                                       \
            for (int64_t d = 0; d < D; d++) {                                               \
                float v = ROUND(TO_F(xr[d]) + TO_F(res_in[i * D + d]));                     \
                res_out[i * D + d] = FROM_F(v);                                             \
                ss += v * v;                                                                \
            }                                                                               \
            xr = res_out + i * D;                                                           \
        } else {                                                                            \
            for (int64_t d = 0; d < D; d++) { float v = TO_F(xr[d]); ss += v * v; }         \
        }                                                                                   \
        float inv = 1.f / sqrtf(ss / (float)D + eps);                                       \
        for (int64_t d = 0; d < D; d++)                                                     \
            o[d] = FROM_F(ROUND(TO_F(wr[d]) * ROUND(TO_F(xr[d]) * inv)));                   \
    }                                                                                       \
}

RMSNORM(rmsnorm_bf16, uint16_t, bf16_to_f32, round_bf16, f32_to_bf16)
RMSNORM(rmsnorm_f32, float, id_f32, id_f32, id_f32)
"""


def _enabled() -> bool:
    if os.environ.get("MINISGL_CPU_KERNELS", "1") in ("0", "false", "no"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cache_dir() -> Path:
    root = os.environ.get("MINISGL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minisgl"
    )
    return Path(root) / "kernels"


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256((_SOURCE + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu-kernels-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "gemv.c"
        src.write_text(_SOURCE)
        lib = Path(tmp) / "gemv.so"
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(src), "-o"]
        result = subprocess.run(cmd + [str(lib), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            logger.info("CPU gemv kernel not built (%s): %s", cc, result.stderr[-500:])
            return None
        os.replace(lib, out)  # atomic: concurrent builders (TP ranks) agree on one file
    return out


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        args: list[Any] = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        for fn in (lib.gemv_bf16, lib.gemv_f32):
            fn.argtypes = args
            fn.restype = None
        self.bf16, self.f32 = lib.gemv_bf16, lib.gemv_f32
        attn_args: list[Any] = [ptr] * 5 + [i64, ptr, i64, i64, i64, i64, ctypes.c_float]
        for fn in (lib.decode_attn_bf16, lib.decode_attn_f32):
            fn.argtypes = attn_args
            fn.restype = None
        self.attn_bf16, self.attn_f32 = lib.decode_attn_bf16, lib.decode_attn_f32
        norm_args: list[Any] = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ctypes.c_float]
        for fn in (lib.rmsnorm_bf16, lib.rmsnorm_f32):
            fn.argtypes = norm_args
            fn.restype = None
        self.norm_bf16, self.norm_f32 = lib.rmsnorm_bf16, lib.rmsnorm_f32


_LIB: _Lib | None = None
_TRIED = False


def load() -> _Lib | None:
    """The compiled kernel, or None where it cannot be used here."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            path = _build() if _enabled() else None
            _LIB = _Lib(path) if path is not None else None
        except OSError as e:
            logger.info("CPU gemv kernel unavailable: %s", e)
            _LIB = None
    return _LIB


def supports(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.dim() == 2
        and weight.shape[1] % (16 if weight.dtype == torch.bfloat16 else 8) == 0
        and weight.is_contiguous()
        and load() is not None
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight.T -> [M, N] in `out_dtype` (default x's dtype)."""
    lib = load()
    assert lib is not None
    xf = x.contiguous().float()
    m, k = xf.shape
    n = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n, dtype=out_dtype)
    fn = lib.bf16 if weight.dtype == torch.bfloat16 else lib.f32
    fn(xf.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, int(out_dtype == torch.bfloat16))
    return y


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per request: q [B, Hq, D] over the pool rows `slots` [B, kmax] (int64, the
    first lens[b] valid) of k/v_pool [S, Hkv, D] -> [B, Hq * D] in q's dtype."""
    lib = load()
    assert lib is not None
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    qf = q.contiguous().float()
    out = torch.empty(b, hq, d, dtype=torch.float32)
    fn = lib.attn_bf16 if k_pool.dtype == torch.bfloat16 else lib.attn_f32
    fn(
        qf.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        slots.shape[1],
        out.data_ptr(),
        b,
        hq,
        hkv,
        d,
        scale,
    )
    return out.view(b, hq * d).to(q.dtype)


def supports_decode_attention(pool: torch.Tensor) -> bool:
    return (
        pool.device.type == "cpu"
        and pool.dtype in (torch.bfloat16, torch.float32)
        and pool.shape[-1] % 8 == 0
        and pool.is_contiguous()
        and load() is not None
    )


def rms_norm_supported(x: torch.Tensor) -> bool:
    """x [M, ..., D] with unit stride in the last dim and rows a fixed stride apart."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.stride(-1) == 1
        and load() is not None
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight * normalise(x [+ residual]) over the last dim; `weight` is [D] or [H, D] (per
    head: x is [T, H, D]). Returns (out, x + residual or None) as new contiguous tensors."""
    lib = load()
    assert lib is not None
    d = x.shape[-1]
    rows = x.numel() // d
    # Rows: [T, D] at any token stride, or [T, H, D] with each token's H heads packed.
    if x.dim() == 3 and x.stride(1) != d:
        x = x.contiguous()
    group = x.shape[1] if x.dim() == 3 else 1
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    res_in = residual.contiguous() if residual is not None else None
    fn = lib.norm_bf16 if x.dtype == torch.bfloat16 else lib.norm_f32
    fn(
        x.data_ptr(),
        group,
        x.stride(0),
        res_in.data_ptr() if res_in is not None else None,
        res_out.data_ptr() if res_out is not None else None,
        w.data_ptr(),
        w.numel() // d,
        out.data_ptr(),
        rows,
        d,
        eps,
    )
    return out, res_out
