"""y = x @ W.T for a quantized weight W (a QTensor)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv, cpu_panel
from minisgl.quant.cpu_choice import QuantKernel
from minisgl.quant.qtensor import QTensor, dequantize

# Elements of weight dequantized at once per matmul call: bounds the transient memory
# (16 MiB of fp32) while keeping each F.linear large enough to run at full speed.
CHUNK_ELEMENTS = 1 << 22


def qlinear(
    x: torch.Tensor,
    w: QTensor,
    kernel: Callable[[torch.Tensor, QTensor], torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight.T in `out_dtype` (default x's): on the CPU by the C kernels
    (cpu_gemv.py), through `kernel` (the picks measured for this shape, cpu_choice.py) where
    given, else by the untuned policy (the quantized GEMV up to cpu_kernels.MAX_ROWS rows,
    dequantized chunks and our GEMM above); elsewhere (CUDA, desc_act's scattered groups, no
    kernels) the weight dequantized a block of rows at a time by torch (never whole). On a GPU,
    `kernel` is the path set up at load (cuda_matmul.py) over buffers it converted. The C
    kernels write `out_dtype` themselves (a float32 LM head's logits unrounded); the others'
    results are converted. A weight with group mins: their term subtracted after the kernels,
    or, from cpu_panel.FOLD_MINS_ROWS rows, folded into the panels of a pick that dequantizes
    them (with_mins); the dequantizing path below includes them itself."""
    if kernel is not None and x.device.type != "cpu":
        return through(kernel, x, w, out_dtype)
    if cpu_gemv.usable(x, w):
        if w.mins is None:
            return _c_kernels(x, w, kernel, out_dtype)
        return with_mins(lambda x, bare, dtype: _c_kernels(x, bare, kernel, dtype), kernel, x, w,
                         out_dtype)  # fmt: skip
    n = w.codes.shape[0]
    rows = max(1, CHUNK_ELEMENTS // max(w.in_features, 1))
    if rows >= n:
        return _as(F.linear(x, dequantize(w, x.dtype)), out_dtype)
    out = x.new_empty(*x.shape[:-1], n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[..., r0:r1] = F.linear(x, dequantize(w, x.dtype, r0, r1))
    return _as(out, out_dtype)


def _c_kernels(
    x: torch.Tensor,
    w: QTensor,
    kernel: Callable[[torch.Tensor, QTensor], torch.Tensor] | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x @ w.T by the C kernels (cpu_gemv.usable holds): `kernel`'s picks, else the untuned
    policy."""
    if kernel is not None:
        return through(kernel, x, w, out_dtype)
    if x.shape[0] <= cpu_kernels.MAX_ROWS:
        return cpu_gemv.qgemv(x, w, out_dtype)
    return cpu_gemv.dequant_gemm(x, w, out_dtype)


def through(
    kernel: Callable[[torch.Tensor, QTensor], torch.Tensor],
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """kernel(x, w) in `out_dtype`: written so by a CPU QuantKernel, converted after others."""
    if isinstance(kernel, QuantKernel):
        return kernel(x, w, out_dtype)
    return _as(kernel(x, w), out_dtype)


def _as(y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return y if dtype is None else y.to(dtype)


def with_mins(
    run: Callable[[torch.Tensor, QTensor, torch.dtype], torch.Tensor],
    kernel: Callable[[torch.Tensor, QTensor], torch.Tensor] | None,
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x @ W.T for a weight with group mins as cpu_panel.run_mins runs it, for `kernel`'s pick
    at x's rows (a QuantKernel's; other kernels fold nothing)."""
    pick = kernel.pick(x.shape[0]) if isinstance(kernel, QuantKernel) else None
    return cpu_panel.run_mins(pick, run, x, w, out_dtype)
