"""--quantization: a float checkpoint's linear weights quantized as they stream in, one tensor
at a time (the float model is never whole in memory).

- int8: symmetric, one scale per output row: code = round(w / s) + 128, s = max|w| / 127.
- int4: one scale and zero point per row and group of INT4_GROUP input features:
  s = (max - min) / 15, zero = round(-min / s), code = clamp(round(w / s) + zero, 0, 15).
- fp8: e4m3 codes with one scale per FP8_BLOCK x FP8_BLOCK block: s = max|w| / 448 (the LM
  head's fp8: one scale per row, group_size 0).
"""

from __future__ import annotations

import torch

from minisgl.quant.qtensor import FP8, QTensor, pack_nibbles
from minisgl.quant.scheme import QuantScheme

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_TINY = 1e-12  # an all-zero row or group still gets a usable (non-zero) scale


# Rows quantized at a time: each step's float32 temporaries stay ~16 MiB a 1024-wide row block
# where a whole LM head's (151936 x 4096) took ~2.5 GB each, several at once (a multiple of
# every fp8 block size, so blocks never straddle two steps).
CHUNK_ROWS = 4096


def quantize(w: torch.Tensor, scheme: QuantScheme, chunk_rows: int = CHUNK_ROWS) -> QTensor:
    """Rows are independent in every scheme (fp8's blocks within chunk_rows), so a big weight
    is quantized chunk_rows at a time: the same codes, a fraction of the transient memory."""
    if scheme.method == "fp8" and scheme.group_size:
        chunk_rows = max(scheme.group_size, chunk_rows // scheme.group_size * scheme.group_size)
    if w.shape[0] <= chunk_rows:
        return _quantize(w, scheme)
    parts = [_quantize(w[r : r + chunk_rows], scheme) for r in range(0, w.shape[0], chunk_rows)]
    first = parts[0]
    return QTensor(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        None if first.zeros is None else torch.cat([p.zeros for p in parts if p.zeros is not None]),
        None,
        first.bits,
        first.group_size,
        first.in_features,
    )


def _quantize(w: torch.Tensor, scheme: QuantScheme) -> QTensor:
    w = w.float()
    if scheme.method == "int8":
        return _int8(w)
    if scheme.method == "int4":
        return _int4(w, scheme.group_size)
    if scheme.group_size == 0:
        return _fp8_rows(w)
    return _fp8(w, scheme.group_size)


def _int8(w: torch.Tensor) -> QTensor:
    n, k = w.shape
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(_TINY)
    codes = (torch.round(w / scale).clamp(-127, 127) + 128).to(torch.uint8)
    zeros = torch.full((n, 1), 128, dtype=torch.uint8)
    return QTensor(codes, scale, zeros, None, 8, 0, k)


def _grouped(w: torch.Tensor, g: int) -> torch.Tensor:
    """[N, K] -> [N, G, g], the last group padded with zeros (which every group's range
    holds anyway: min <= 0 <= max is forced below)."""
    n, k = w.shape
    pad = -k % g
    return torch.nn.functional.pad(w, (0, pad)).view(n, -1, g)


def _int4(w: torch.Tensor, g: int) -> QTensor:
    n, k = w.shape
    if k % 2:
        raise ValueError(f"int4 needs an even number of input features, not {k}")
    wg = _grouped(w, g)
    lo = wg.amin(dim=2).clamp_max(0)
    hi = wg.amax(dim=2).clamp_min(0)
    scale = ((hi - lo) / 15).clamp_min(_TINY)
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = (torch.round(wg / scale.unsqueeze(2)) + zero.unsqueeze(2)).clamp(0, 15)
    codes = codes.view(n, -1)[:, :k]
    return QTensor(pack_nibbles(codes), scale, zero.to(torch.uint8), None, 4, g, k)


def _fp8(w: torch.Tensor, b: int) -> QTensor:
    n, k = w.shape
    pn, pk = -n % b, -k % b
    blocks = torch.nn.functional.pad(w, (0, pk, 0, pn)).view((n + pn) // b, b, (k + pk) // b, b)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_TINY)  # [N/b, K/b]
    rows = scale.repeat_interleave(b, dim=0)[:n]  # [N, K/b]
    per_feature = rows.repeat_interleave(b, dim=1)[:, :k]
    codes = (w / per_feature).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return QTensor(codes, rows.contiguous(), None, None, 8, b, k)


def _fp8_rows(w: torch.Tensor) -> QTensor:
    k = w.shape[1]
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)  # [N, 1]
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return QTensor(codes, scale, None, None, 8, 0, k)
