"""Decode-sized matmuls over quantized weights on the CPU, by the C GEMV in
layers/csrc/qgemv.c: it reads each code byte once and widens it in registers, so a decode step
streams the quantized bytes (a half or a quarter of bf16's) instead of dequantizing a float
copy of every weight first. Taken for up to cpu_kernels.MAX_ROWS rows (the dense layers'
untuned GEMV policy) where groups are contiguous runs of a multiple of 8 input features;
elsewhere (more rows, desc_act's scattered groups, no kernels here) qtensor.qlinear
dequantizes a block of rows at a time."""

from __future__ import annotations

import torch

from minisgl.layers import cpu_kernels
from minisgl.quant.qtensor import FP8, QTensor


def _kind(w: QTensor) -> str:
    if w.codes.dtype == FP8:
        return "fp8"
    return "u4" if w.bits == 4 else "u8"


def usable(x: torch.Tensor, w: QTensor) -> bool:
    k = w.in_features
    gs = w.group_size or k
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= cpu_kernels.MAX_ROWS
        and w.g_idx is None
        and k % gs == 0
        and gs % 8 == 0
        and w.scales.shape[1] == k // gs
        and w.codes.is_contiguous()
        and _kind(w) in _lib_qgemv()
    )


def _lib_qgemv() -> dict:
    lib = cpu_kernels.load()
    return lib.qgemv if lib is not None else {}


def qgemv(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in x's dtype (fp32 inside)."""
    lib = cpu_kernels.load()
    assert lib is not None
    (m, k), n = x.shape, w.codes.shape[0]
    gs = w.group_size or k
    xf = x.contiguous().float()
    # x summed per group: the zero points' share, the same for every output row.
    xsum = xf.view(m, k // gs, gs).sum(-1).contiguous()
    scales = w.scales.contiguous()
    zeros = w.zeros.contiguous() if w.zeros is not None else None
    y = torch.empty(m, n, dtype=torch.float32)
    lib.qgemv[_kind(w)](
        xf.data_ptr(),
        xsum.data_ptr(),
        w.codes.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr() if zeros is not None else None,
        y.data_ptr(),
        m,
        n,
        k,
        gs,
    )
    return y.to(x.dtype)
