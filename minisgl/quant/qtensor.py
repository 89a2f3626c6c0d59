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
            [N, G]   uint8, the compact form of the K-quants whose min is a super-block's
                     dmin times a small integer m (Q4_K, Q5_K, Q2_K): m, with
    mins_scales [N, G / mins_per] float32 dmin (min = dmin * m, exact in float32: the same
                     mins as the float32 form, in 1 + 4 / mins_per bytes a group for 4)

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
from collections.abc import Callable
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
    mins_scales: torch.Tensor | None = None

    @property
    def mins_per(self) -> int:
        """Groups under each entry of mins_scales (0: float32 mins, or none)."""
        return _per(self.mins, self.mins_scales)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.in_features)

    def dim(self) -> int:
        return 2

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.zeros, self.g_idx, self.mins, self.mins_scales)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> QTensor:
        """Rows (dim 0) or input features (dim 1) [start, start + length)."""
        if dim == 0:
            zeros = self.zeros.narrow(0, start, length) if self.zeros is not None else None
            return replace(
                self,
                codes=self.codes.narrow(0, start, length),
                scales=self.scales.narrow(0, start, length),
                zeros=zeros,
                **_mins_part(self, lambda t: t.narrow(0, start, length)),
            )
        per_byte = 2 if self.codes.dtype == torch.uint8 and self.bits == 4 else 1
        if start % per_byte or length % per_byte:
            raise ValueError("a 4-bit weight splits only at even input features")
        codes = self.codes.narrow(1, start // per_byte, length // per_byte)
        if self.g_idx is not None:  # groups are scattered: keep every group's scale
            g_idx = self.g_idx.narrow(0, start, length)
            return replace(self, codes=codes, g_idx=g_idx, in_features=length)
        g = self.group_size
        if g and (start % g or length % g) and (start, length) != (0, self.in_features):
            return self._regrouped(codes, start, length)
        if not g:
            return replace(self, codes=codes, in_features=length)
        first, count = start // g, -(-length // g)
        zeros = self.zeros.narrow(1, first, count) if self.zeros is not None else None
        scales = self.scales.narrow(1, first, count)
        mins = self._mins_narrowed(first, count)
        return replace(self, codes=codes, scales=scales, zeros=zeros, in_features=length, **mins)

    def _mins_narrowed(self, first: int, count: int) -> dict:
        """Groups [first, first + count) of the mins as QTensor's fields: compact where they
        are whole super-blocks, else in float32."""
        m, d, per = self.mins, self.mins_scales, self.mins_per
        if m is None or d is None:
            return {"mins": m.narrow(1, first, count) if m is not None else None}
        if first % per or count % per:  # a cut inside a super-block
            m = self.float_mins()
            assert m is not None
            return {"mins": m.narrow(1, first, count), "mins_scales": None}
        return {
            "mins": m.narrow(1, first, count),
            "mins_scales": d.narrow(1, first // per, count // per),
        }

    def _regrouped(self, codes: torch.Tensor, start: int, length: int) -> QTensor:
        """Input features [start, start + length) cut inside a group (a tensor-parallel rank's
        share of a row-parallel weight): held in groups of g' = gcd(group, start, length), each
        carrying the scale, zero point and min of the group it is part of. The same weights,
        bit for bit: weight[n, k] reads the same (code, zero, scale, min) as before."""
        g = math.gcd(self.group_size, start, length)
        first = torch.arange(start, start + length, g, device=self.scales.device)
        of = first // self.group_size  # each new group's group in the source
        zeros = self.zeros.index_select(1, of) if self.zeros is not None else None
        float_mins = self.float_mins()
        mins = float_mins.index_select(1, of) if float_mins is not None else None
        scales = self.scales.index_select(1, of)
        return QTensor(codes, scales, zeros, None, self.bits, g, length, mins)

    def float_mins(self, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The group mins [N, G] (or those of `rows`) in float32, whichever form holds them
        (the compact form's dmin * m: exact in float32)."""
        m, d = self.mins, self.mins_scales
        if m is None:
            return None
        if rows is not None:
            m = m.index_select(0, rows)
            d = d.index_select(0, rows) if d is not None else None
        return m if d is None else m.float() * d.repeat_interleave(self.mins_per, dim=-1)

    def mins_args(self) -> tuple[int, int, int, int, int]:
        """The mins as the C kernels take them (cpu_kernels.MINS_ARGS; common.h's Mins): their
        pointer and row stride, the compact form's dmin pointer and row stride (0, 0: float32
        mins), groups per dmin."""
        m, d = self.mins, self.mins_scales
        assert m is not None and m.stride(-1) == 1
        if d is None:
            return (m.data_ptr(), m.stride(-2), 0, 0, 0)
        per = self.mins_per  # a power of 2 of at least 8 (the C reads 8 mins under one dmin)
        assert d.stride(-1) == 1 and per >= 8 and per & (per - 1) == 0
        return (m.data_ptr(), m.stride(-2), d.data_ptr(), d.stride(-2), per)

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
        if self.mins is None or src.mins is None:
            return self._copy_g_idx(src)
        if self.mins_scales is not None:  # the compact form where the source has it
            if src.mins_scales is None or src.mins_per != self.mins_per:
                raise ValueError("group mins in another form than the layer holds")
            _copy("mins", self.mins, src.mins)
            _copy("mins' scales", self.mins_scales, src.mins_scales.float())
        else:
            float_mins = src.float_mins()
            assert float_mins is not None
            _copy("mins", self.mins, float_mins.float())
        return self._copy_g_idx(src)

    def _copy_g_idx(self, src: QTensor) -> QTensor:
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
    return replace(
        w,
        codes=w.codes.index_select(0, flat),
        scales=w.scales.index_select(0, flat),
        zeros=zeros,
        **_mins_part(w, lambda t: t.index_select(0, flat)),
    )


def _per(mins: torch.Tensor | None, dmin: torch.Tensor | None) -> int:
    """Groups per dmin of compact mins (m [.., G], dmin [.., G / per]); 0: none such."""
    return mins.shape[-1] // dmin.shape[-1] if mins is not None and dmin is not None else 0


def _mins_part(w: QTensor, rows: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """w's mins (either form) with `rows` applied: QTensor fields for `replace`."""
    return {
        "mins": rows(w.mins) if w.mins is not None else None,
        "mins_scales": rows(w.mins_scales) if w.mins_scales is not None else None,
    }


def without_mins(w: QTensor) -> QTensor:
    """w's codes, scales and zero points alone: what the kernels multiply by (see minus_mins).
    Made once per QTensor: the C kernels' operands are built once per QTensor they are given
    (cpu_gemv.operands), and a layer's whole view is asked for it at every matmul."""
    bare: QTensor | None = w.__dict__.get("_without_mins")
    if bare is None or bare.codes is not w.codes or bare.scales is not w.scales:
        bare = w.__dict__["_without_mins"] = replace(w, mins=None, mins_scales=None)
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
    mins = w.float_mins()
    if mins is not None:
        values -= per_feature(mins[start:end], w)
    return values.to(dtype)
