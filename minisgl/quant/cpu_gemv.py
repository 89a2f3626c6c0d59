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

import ctypes
from typing import Any

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
    """Whether the C kernels can multiply x by w (any row count): groups of a multiple of 32
    features, or 8-bit codes in groups of 16 where the build has no VNNI panels (which take
    those: cpu_vpanel.takes_groups_of_16; here qgemv and the dequantizing kernels do, not
    int16_panel)."""
    k = w.in_features
    gs = w.group_size or k
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and w.g_idx is None
        and k % gs == 0
        and (
            gs % 32 == 0 or (gs == 16 and k % 32 == 0 and kind(w) == "u8" and takes_groups_of_16())
        )
        and w.scales.shape[1] == k // gs
        and w.codes.stride(1) == 1
        and w.scales.stride(1) == 1
        and (w.zeros is None or w.zeros.stride() == w.scales.stride())
        and kind(w) in _lib_qgemv()
    )


def takes_int8_activations(w: QTensor) -> bool:
    """Whether --cpu-quantized-activations int8 can round x for w: integer codes whose groups
    the C kernels' 8-bit path takes (qgemv.c's qgemv_x8_takes: 4-bit codes in groups of 64 or
    more, or of 32 where K is a multiple of 64; with AVX512-VNNI also 8-bit codes in groups of
    32 or a multiple of 64, K a multiple of 64); fp8 codes and scattered groups (desc_act)
    stay exact."""
    lib = cpu_kernels.load()
    if lib is None or kind(w) == "fp8" or w.g_idx is not None:
        return False
    k = w.in_features
    return bool(lib.qgemv_x8_takes(w.bits, k, w.group_size or k))


def takes_8_bit_codes() -> bool:
    """Whether --cpu-quantized-activations int8 takes 8-bit codes here (AVX512-VNNI builds)."""
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.qgemv_x8_takes(8, 1024, 1024))


def takes_groups_of_16() -> bool:
    """Whether qgemv and the dequantizing kernels run 8-bit codes in groups of 16 (GGUF's Q6_K,
    Q3_K, Q2_K) here: in builds without the VNNI panels, which take them there (AVX2)."""
    lib = cpu_kernels.load()
    return lib is not None and "u8" in lib.qgemv and "u8" not in lib.qvpanel


def _lib_qgemv() -> dict:
    lib = cpu_kernels.load()
    return lib.qgemv if lib is not None else {}


class Operands:
    """What the C kernels take for one weight, built once per QTensor (a decode step calls
    ~110 matmuls, each call's Python on caches the weight stream evicted): the code kind, the
    weight's own arguments (codes, code row stride in bytes, scales, zero points or None,
    group row stride in elements), N, K and the group size. Kept while the QTensor holds the
    same code, scale and zero-point tensors (`operands`)."""

    __slots__ = ("codes", "scales", "zeros", "ptrs", "kind", "args", "n", "k", "group", "sizes")

    def __init__(self, w: QTensor) -> None:
        self.codes, self.scales, self.zeros = w.codes, w.scales, w.zeros
        self.kind = kind(w)
        self.n, self.k = w.codes.shape[0], w.in_features
        self.group = w.group_size or w.in_features
        # As ctypes values: the call converts none of them (~0.4 us a call less than ints).
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.ptrs = _pointers(w)
        stride = w.codes.stride(0) * w.codes.element_size()
        codes, scales, zeros = self.ptrs
        self.args = (ptr(codes), i64(stride), ptr(scales), ptr(zeros), i64(w.scales.stride(0)))
        self.sizes = (i64(self.n), i64(self.k), i64(self.group))  # N, K, group size


def _pointers(w: QTensor) -> tuple[int, int, int | None]:
    zeros = w.zeros.data_ptr() if w.zeros is not None else None
    return w.codes.data_ptr(), w.scales.data_ptr(), zeros


def operands(w: QTensor) -> Operands:
    """w's Operands, made again where its tensors were replaced (a new shard, a device move)
    or their storage was (hugepages.move_onto swaps `.data` under the same tensor; zero points
    move only with their 4x larger scales)."""
    ops: Operands | None = w.__dict__.get("_c_operands")
    if (
        ops is None
        or ops.codes is not w.codes
        or ops.scales is not w.scales
        or ops.zeros is not w.zeros
        or ops.ptrs[0] != w.codes.data_ptr()
        or ops.ptrs[1] != w.scales.data_ptr()
    ):
        ops = w.__dict__["_c_operands"] = Operands(w)
    return ops


def qgemv(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype)."""
    ops = operands(w)
    x_bf16 = x.dtype == torch.bfloat16
    xc = x.contiguous() if x_bf16 or x.dtype == torch.float32 else x.float().contiguous()
    m, k = xc.shape
    if k != ops.k:  # the kernel would read past x's rows
        raise ValueError(f"x {tuple(x.shape)} @ a quantized weight of K = {ops.k}")
    out_dtype = out_dtype or x.dtype
    y_bf16 = out_dtype == torch.bfloat16
    y = torch.empty(m, ops.n, dtype=torch.bfloat16 if y_bf16 else torch.float32)
    # The table looked up per call, not kept in Operands: benchmarks wrap its entries.
    _lib().qgemv[ops.kind](xc.data_ptr(), x_bf16, *ops.args, y.data_ptr(), y_bf16, m, *ops.sizes)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _lib() -> Any:
    lib = cpu_kernels._LIB if cpu_kernels._TRIED else cpu_kernels.load()
    assert lib is not None
    return lib


def dequant_rows(w: QTensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of w as fp32 [end - start, K] (equal to qtensor.dequantize's)."""
    ops = operands(w)
    out = torch.empty(end - start, ops.k, dtype=torch.float32)
    _lib().qdequant[ops.kind](*ops.args, out.data_ptr(), start, end, *ops.sizes[1:])
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
