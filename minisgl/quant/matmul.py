"""y = x @ W.T for a quantized weight W (a QTensor)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv, cpu_panel
from minisgl.quant.cpu_choice import QuantKernel
from minisgl.quant.qtensor import QTensor, dequantize, without_mins

# Elements of weight dequantized at once per matmul call: bounds the transient memory
# (16 MiB of fp32) while keeping each F.linear large enough to run at full speed.
CHUNK_ELEMENTS = 1 << 22


# Rows of x from which the picks that dequantize panels into bf16 (amx_panel, amx_bf16_vpanel)
# take a weight's group mins into the panel's values (cpu_panel.mins_folded) instead of
# qmins.c's term after the matmul (M x N x groups multiply-adds: ~375 ms of the 641 a Q4_1
# file's 1024-token prefill lost to bf16 on a Zen 4): past the decode chain's steps
# (layers/cpu_chain.MAX_ROWS rows), whose bits the layer path keeps by the same kernels and
# term.
FOLD_MINS_ROWS = 65


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
    results are converted. A weight with group mins: their term subtracted after the kernels
    (minus_mins), or, from FOLD_MINS_ROWS rows, folded into the panels of a pick that
    dequantizes them (with_mins); the dequantizing path below includes them itself."""
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
    """x @ W.T for a weight with group mins: where FOLD_MINS_ROWS or more rows of x run on a
    pick of `kernel` that folds them into its panel, that (cpu_panel.mins_folded); else
    `run(x, bare, dtype)`, x times the weight without its mins in `dtype`, less their term
    (minus_mins)."""
    if x.shape[0] >= FOLD_MINS_ROWS and isinstance(kernel, QuantKernel):
        folded = cpu_panel.mins_folded(kernel.pick(x.shape[0]), x, w, out_dtype)
        if folded is not None:
            return folded
    bare = without_mins(w)
    return minus_mins(lambda x, dtype: run(x, bare, dtype), x, w, out_dtype)


def minus_mins(
    run: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x @ W.T for a weight with group mins (weight = (code - zero) * scale - min), where
    `run(x, dtype)` multiplies by the rest in `dtype` on the CPU: that in float32, less each
    group's min times the sum of x over the group, rounded once to `out_dtype` (default x's),
    by csrc/qmins.c (the decode chain's call: the same bits)."""
    lib = cpu_kernels.load()
    assert lib is not None and w.mins is not None and w.g_idx is None and x.dim() == 2
    x = x.contiguous()
    acc = run(x, torch.float32)
    dtype = out_dtype or x.dtype
    y = acc if dtype == torch.float32 else torch.empty_like(acc, dtype=dtype)
    n, k = acc.shape[1], w.in_features
    done = lib.qmins(
        x.data_ptr(), int(x.dtype == torch.bfloat16), acc.data_ptr(), w.mins.data_ptr(),
        w.mins.stride(0), y.data_ptr(), int(dtype == torch.bfloat16), x.shape[0], n, k,
        w.group_size or k,
    )  # fmt: skip
    if not done:
        raise MemoryError(f"no memory for the group sums of {x.shape[0]} rows of x (qmins)")
    return y
