"""A quantized linear weight as minisgl holds it, whatever file format it came from.

One layout for every scheme, so one dequantizer (and later one kernel per code width) serves
FP8, AWQ, GPTQ, compressed-tensors and the formats made at load:

    codes   [N, K/2] uint8  4-bit codes, input feature 2j in the low nibble, 2j+1 in the high
            [N, K]   uint8  8-bit integer codes
            [N, K]   float8_e4m3fn
    scales  [N, G]   float32, one per output row and group of input features
    zeros   [N, G]   uint8 zero points of integer codes (symmetric formats store the midpoint)
    g_idx   [K]      int32 group of each input feature, only where groups are not contiguous
                     (GPTQ desc_act); otherwise input feature k is in group k // group_size
    mins    [N, G]   float32, only for formats whose groups carry a float offset (llama.cpp's
                     K-quants: weight = d * q - m, m no whole multiple of d)

    weight[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)] - min[n, g(k)]
                                                                    (fp8: code * scale)

The kernels read codes, scales and zero points; a weight with mins gets their term,
sum_g min[n, g] * (sum of x over group g), subtracted after them (cpu_panel.minus_mins).

`QTensor` is that set of tensors (a full checkpoint tensor, or a view into a layer's buffers);
`narrow` cuts a tensor-parallel shard out of it and `copy_` fills a layer's buffers from it,
so the tensor-parallel linear layers load quantized weights with the code they load float
weights with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch

FP8 = torch.float8_e4m3fn


@dataclass
class QTensor:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int  # input features per group; 0: the whole row is one group
    in_features: int
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.in_features)

    def dim(self) -> int:
        return 2

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.zeros, self.g_idx, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> QTensor:
        """Rows (dim 0) or input features (dim 1) [start, start + length)."""
        if dim == 0:
            zeros = self.zeros.narrow(0, start, length) if self.zeros is not None else None
            mins = self.mins.narrow(0, start, length) if self.mins is not None else None
            return QTensor(
                self.codes.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                zeros,
                self.g_idx,
                self.bits,
                self.group_size,
                self.in_features,
                mins,
            )
        per_byte = 2 if self.codes.dtype == torch.uint8 and self.bits == 4 else 1
        if start % per_byte or length % per_byte:
            raise ValueError("a 4-bit weight splits only at even input features")
        codes = self.codes.narrow(1, start // per_byte, length // per_byte)
        if self.g_idx is not None:  # groups are scattered: keep every group's scale
            return QTensor(
                codes,
                self.scales,
                self.zeros,
                self.g_idx.narrow(0, start, length),
                self.bits,
                self.group_size,
                length,
                self.mins,
            )
        g = self.group_size
        if g and (start % g or length % g) and (start, length) != (0, self.in_features):
            return self._regrouped(codes, start, length)
        scales, zeros, mins = self.scales, self.zeros, self.mins
        if g:
            first, count = start // g, -(-length // g)
            scales = scales.narrow(1, first, count)
            zeros = zeros.narrow(1, first, count) if zeros is not None else None
            mins = mins.narrow(1, first, count) if mins is not None else None
        return QTensor(codes, scales, zeros, None, self.bits, g, length, mins)

    def _regrouped(self, codes: torch.Tensor, start: int, length: int) -> QTensor:
        """Input features [start, start + length) cut inside a group (a tensor-parallel rank's
        share of a row-parallel weight): held in groups of g' = gcd(group, start, length), each
        carrying the scale, zero point and min of the group it is part of. The same weights,
        bit for bit: weight[n, k] reads the same (code, zero, scale, min) as before."""
        g = math.gcd(self.group_size, start, length)
        first = torch.arange(start, start + length, g, device=self.scales.device)
        of = first // self.group_size  # each new group's group in the source
        zeros = self.zeros.index_select(1, of) if self.zeros is not None else None
        mins = self.mins.index_select(1, of) if self.mins is not None else None
        scales = self.scales.index_select(1, of)
        return QTensor(codes, scales, zeros, None, self.bits, g, length, mins)

    def copy_(self, src: QTensor) -> QTensor:
        """Fill these (buffer view) tensors from `src`, checking it has the same layout."""
        if (src.bits, src.group_size, src.in_features) != (
            self.bits,
            self.group_size,
            self.in_features,
        ):
            raise ValueError(
                f"quantized weight of {src.bits} bits, group {src.group_size}, "
                f"{src.in_features} inputs where {self.bits} bits, group {self.group_size}, "
                f"{self.in_features} inputs are expected"
            )
        _copy("codes", self.codes, src.codes)
        _copy("scales", self.scales, src.scales.float())
        if self.zeros is not None:
            assert src.zeros is not None, "integer codes without zero points"
            _copy("zero points", self.zeros, src.zeros)
        if (self.mins is None) != (src.mins is None):
            raise ValueError("a quantized weight with group mins where none are held, or none")
        if self.mins is not None:
            assert src.mins is not None
            _copy("mins", self.mins, src.mins.float())
        if self.g_idx is not None:
            if src.g_idx is None:
                raise ValueError("a weight without g_idx where desc_act needs one")
            if bool((self.g_idx < 0).all()):
                self.g_idx.copy_(src.g_idx)
            elif not torch.equal(self.g_idx, src.g_idx.to(self.g_idx.device)):
                # Fused projections (q/k/v, gate/up) share one input order; GPTQ gives them
                # the same g_idx since their inputs (and Hessians) are the same.
                raise ValueError("fused projections with different g_idx (desc_act order)")
        return self


class Coded(Protocol):
    """What holds a weight's codes, scales and zero points (QTensor, QuantWeight)."""

    @property
    def codes(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def zeros(self) -> torch.Tensor | None: ...


def streamed(w: Coded) -> list[torch.Tensor]:
    """The tensors a kernel reads for w: its codes, scales and zero points where it has them
    (moved onto huge pages together, flushed before a timed pass)."""
    return [t for t in (w.codes, w.scales, w.zeros) if t is not None]


def take_rows(w: QTensor, ids: torch.Tensor) -> QTensor:
    """The rows `ids` (any shape, flattened) of a weight: its codes, scales and zero points
    gathered, for an embedding lookup from a quantized table."""
    flat = ids.reshape(-1)
    zeros = w.zeros.index_select(0, flat) if w.zeros is not None else None
    mins = w.mins.index_select(0, flat) if w.mins is not None else None
    return QTensor(
        w.codes.index_select(0, flat),
        w.scales.index_select(0, flat),
        zeros,
        w.g_idx,
        w.bits,
        w.group_size,
        w.in_features,
        mins,
    )


def without_mins(w: QTensor) -> QTensor:
    """w's codes, scales and zero points alone: what the kernels multiply by (see minus_mins).
    Made once per QTensor: the C kernels' operands are built once per QTensor they are given
    (cpu_gemv.operands), and a layer's whole view is asked for it at every matmul."""
    bare: QTensor | None = w.__dict__.get("_without_mins")
    if bare is None or bare.codes is not w.codes or bare.scales is not w.scales:
        bare = w.__dict__["_without_mins"] = replace(w, mins=None)
    return bare


def _copy(what: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"quantized weight's {what} are {list(src.shape)}, expected {list(dst.shape)}"
        )
    dst.copy_(src)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 (low nibble first)."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., K] integers in 0..15 -> [..., K/2] uint8 (input feature 2j in the low nibble)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def per_feature(t: torch.Tensor, w: QTensor) -> torch.Tensor:
    """[n, G] per-group values -> [n, K] per input feature."""
    if w.g_idx is not None:
        return t.index_select(1, w.g_idx.long())
    if w.group_size == 0:
        return t.expand(-1, w.in_features)
    return t.repeat_interleave(w.group_size, dim=1)[:, : w.in_features]


def dequantize(
    w: QTensor, dtype: torch.dtype, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Rows [start, end) of the weight as a float [n, K] tensor of `dtype` (computed in fp32:
    (code - zero) * scale is exact there for every format here; a min is then subtracted with
    one rounding, as llama.cpp's reference dequantizes its K-quants)."""
    end = w.codes.shape[0] if end is None else end
    codes = w.codes[start:end]
    if codes.dtype == FP8:
        values = codes.float()
    else:
        q = unpack_nibbles(codes) if w.bits == 4 else codes
        assert w.zeros is not None
        values = q.float() - per_feature(w.zeros[start:end].float(), w)
    values = values * per_feature(w.scales[start:end], w)
    if w.mins is not None:
        values -= per_feature(w.mins[start:end], w)
    return values.to(dtype)
