"""RMSNorm with an optional fused residual add (the pre-norm decoder's two-for-one).

On CPU a small C kernel (cpu_kernels.py) does add + norm in one pass where available: the eager
version is ~8 ops of ~5 us each, per norm, 85 norms per step.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers import cpu_kernels
from minisgl.layers.rotary import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). x is a sublayer's fresh output that nothing
        else reads: on CPU the sum goes into its storage (no second buffer a call)."""
        if x.dim() == 2 and cpu_kernels.rms_norm_supported(x):
            out, summed = cpu_kernels.rms_norm(x, self.weight, self.eps, residual, sum_into_x=True)
            assert summed is not None
            return out, summed
        x = x + residual
        return self.forward(x), x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_kernels.rms_norm_supported(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)[0]
        return self.weight * rms_normalize(x, self.eps)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of x [T, H, D] with a per-head weight [H, D]."""
    if cpu_kernels.rms_norm_supported(x):
        return cpu_kernels.rms_norm(x, weight, eps)[0]
    return rms_normalize(x, eps) * weight


def head_rms_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """apply_rotary(head_rms_norm(x, weight, eps), cos, sin): one pass on CPU (the eager rotary
    is five passes over q and k, ~7% of a CPU prefill)."""
    if cpu_kernels.rms_norm_supported(x) and x.shape[-1] <= 512 and cos.dtype == x.dtype:
        return cpu_kernels.rms_norm(x, weight, eps, rope=(cos, sin))[0]
    return apply_rotary(head_rms_norm(x, weight, eps), cos, sin)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32 and returned in x's dtype.

    Bit-identical to transformers' `x.float() * rsqrt(mean(x**2) + eps)` followed by the cast
    (so bf16 results agree with it too), in one fused kernel instead of six.
    """
    return torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
