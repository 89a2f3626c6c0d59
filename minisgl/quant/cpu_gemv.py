"""Matmuls over quantized weights on the CPU, by the C kernels in layers/csrc/qgemv.c:

- `qgemv`: reads each code byte once and widens it in registers or an L1 scratch (integer
  codes against x quantized per row to 16-bit integers, fp8 codes as fp32 bit patterns), so a
  decode step streams the quantized bytes (a half or a quarter of bf16's) and nothing else;
- `dequant_gemm` / `dequant_torch`: for many rows (prefill), a chunk of weight rows
  dequantized once into fp32 by C and multiplied by our fp32 GEMM or by torch's (MKL/oneDNN).

Which runs for which row count is measured at start-up (cpu_choice.py). They take weights
whose groups are contiguous runs of a multiple of 32 input features (every format here but
GPTQ desc_act, which dequantizes through torch: qtensor.dequantize)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant.qtensor import FP8, QTensor

# Weight elements dequantized per chunk for the prefill paths: the fp32 chunk (4 MiB) stays in
# the caches while the GEMM passes over it, and each GEMM call is still large.
CHUNK_ELEMENTS = 1 << 20


def kind(w: QTensor) -> str:
    if w.codes.dtype == FP8:
        return "fp8"
    return "u4" if w.bits == 4 else "u8"


def usable(x: torch.Tensor, w: QTensor) -> bool:
    """Whether the C kernels can multiply x by w (any row count)."""
    k = w.in_features
    gs = w.group_size or k
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and w.g_idx is None
        and k % gs == 0
        and gs % 32 == 0
        and w.scales.shape[1] == k // gs
        and w.codes.stride(1) == 1
        and w.scales.stride(1) == 1
        and (w.zeros is None or w.zeros.stride() == w.scales.stride())
        and kind(w) in _lib_qgemv()
    )


def _lib_qgemv() -> dict:
    lib = cpu_kernels.load()
    return lib.qgemv if lib is not None else {}


def _operands(w: QTensor) -> tuple[int, int, int, int, int]:
    """Pointers and strides the C kernels take: codes, code row stride (bytes), scales, zero
    points (0: none), group row stride (elements)."""
    zeros = w.zeros.data_ptr() if w.zeros is not None else 0
    stride = w.codes.stride(0) * w.codes.element_size()
    return w.codes.data_ptr(), stride, w.scales.data_ptr(), zeros, w.scales.stride(0)


def qgemv(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype)."""
    lib = cpu_kernels.load()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    x_bf16 = x.dtype == torch.bfloat16
    xc = x.contiguous() if x_bf16 or x.dtype == torch.float32 else x.float().contiguous()
    (m, k), n = xc.shape, w.codes.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    codes, cstride, scales, zeros, gstride = _operands(w)
    lib.qgemv[kind(w)](
        xc.data_ptr(),
        int(x_bf16),
        codes,
        cstride,
        scales,
        zeros or None,
        gstride,
        y.data_ptr(),
        int(y.dtype == torch.bfloat16),
        m,
        n,
        k,
        w.group_size or k,
    )
    return y if y.dtype == out_dtype else y.to(out_dtype)


def dequant_rows(w: QTensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of w as fp32 [end - start, K] (equal to qtensor.dequantize's)."""
    lib = cpu_kernels.load()
    assert lib is not None
    k = w.in_features
    out = torch.empty(end - start, k, dtype=torch.float32)
    codes, cstride, scales, zeros, gstride = _operands(w)
    lib.qdequant[kind(w)](
        codes,
        cstride,
        scales,
        zeros or None,
        gstride,
        out.data_ptr(),
        start,
        end,
        k,
        w.group_size or k,
    )
    return out


def _chunked(x: torch.Tensor, w: QTensor, mm, out_dtype: torch.dtype | None) -> torch.Tensor:  # noqa: ANN001
    n, k = w.codes.shape[0], w.in_features
    rows = max(16, CHUNK_ELEMENTS // max(k, 1) // 16 * 16)
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[:, r0:r1] = mm(x, dequant_rows(w, r0, r1))
    return out


def dequant_gemm(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Many rows: each chunk of weight rows dequantized once, then our fp32 GEMM."""
    return _chunked(x, w, lambda xs, d: cpu_kernels.gemm(xs, d, out_dtype or x.dtype), out_dtype)


def dequant_torch(
    x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Many rows: each chunk of weight rows dequantized once, then torch's fp32 matmul."""
    xf = x.float()
    return _chunked(x, w, lambda xs, d: F.linear(xf, d), out_dtype)
