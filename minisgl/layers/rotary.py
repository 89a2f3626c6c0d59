"""Rotary position embedding (the rotate-half layout Qwen3 uses) with the common scalings."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim // 2] (float32) and the cos/sin scale factor."""
    # float32 arithmetic throughout, as transformers does, so the tables agree bit for bit.
    # Built on the CPU explicitly: the model may be constructed under a meta-device context.
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    )
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling, factor), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, factor, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any], factor: float) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(
    dim: int, base: float, s: dict[str, Any], factor: float, max_pos: int
) -> tuple[torch.Tensor, float]:
    orig = int(s.get("original_max_position_embeddings") or max_pos)
    if not s.get("factor"):
        factor = max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


class RotaryEmbedding:
    """Holds a [max_positions, head_dim] float32 cos and sin table per device.

    Not an nn.Module: the table is derived, never loaded, and is built on first use on the
    device the positions live on (so a model created on the meta device needs no fix-up).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
    ) -> None:
        self.head_dim = head_dim
        self.inv_freq, self.attn_factor = inv_frequencies(
            head_dim, theta, scaling, max_position_embeddings
        )
        self.max_positions = max_position_embeddings
        self._table: torch.Tensor | None = None  # [2, max_positions, head_dim]: cos, signed sin

    def _build(self, device: torch.device, need: int) -> torch.Tensor:
        n = max(self.max_positions, need)
        t = torch.arange(n, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attn_factor, emb.sin() * self.attn_factor
        half = self.head_dim // 2
        # The rotate-half sign lives in the sin table: [-sin, sin] (see apply_rotary).
        table = torch.stack((cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)))
        self._table = table
        return table

    def table(self, device: torch.device) -> torch.Tensor:
        """[2, positions, head_dim] float32 on `device`: cos, and sin with the rotate-half sign
        (the CPU decode chain reads its rows itself)."""
        table = self._table
        if table is None or table.device != device:
            table = self._build(device, 1)
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin [T, 1, head_dim] in `dtype` for the tokens at `positions`
        (computed once per step and shared by every layer)."""
        table = self._table
        if table is None or table.device != positions.device:
            table = self._build(positions.device, int(positions.max().item()) + 1)
        # One gather; each half is contiguous [T, 1, D] (a [T, 2, D] gather's halves are not,
        # and every layer's fused norm + rotary would copy them).
        cs = table[:, positions].to(dtype)
        return cs[0].unsqueeze(1), cs[1].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in its own dtype.

    transformers computes x * cos + cat(-x2, x1) * sin; here the sign sits in the table, so
    roll(x) * [-sin, sin] = cat(x2 * -sin, x1 * sin): the same products, bit for bit, in fewer
    ops.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
