"""y = x @ W.T for a quantized weight W (a QTensor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.quant import cpu_gemv
from minisgl.quant.qtensor import QTensor, dequantize

# Elements of weight dequantized at once per matmul call: bounds the transient memory
# (16 MiB of fp32) while keeping each F.linear large enough to run at full speed.
CHUNK_ELEMENTS = 1 << 22


def qlinear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [..., K] @ weight.T: decode-sized inputs on the CPU through the quantized GEMV
    (cpu_gemv.py); otherwise the weight dequantized a block of rows at a time (never whole)."""
    if cpu_gemv.usable(x, w):
        return cpu_gemv.qgemv(x, w)
    n = w.codes.shape[0]
    rows = max(1, CHUNK_ELEMENTS // max(w.in_features, 1))
    if rows >= n:
        return F.linear(x, dequantize(w, x.dtype))
    out = x.new_empty(*x.shape[:-1], n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[..., r0:r1] = F.linear(x, dequantize(w, x.dtype, r0, r1))
    return out
