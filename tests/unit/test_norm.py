"""RMSNorm's residual add on CPU: the sum goes over the sublayer output it consumes."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import cpu_kernels
from minisgl.layers.norm import RMSNorm, rms_normalize

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_forward_sums_into_x_and_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    norm = norm.to(dtype)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    want_sum = x + residual
    want = norm.weight * rms_normalize(want_sum, 1e-6)
    residual_before = residual.clone()
    out, summed = norm.add_forward(x, residual)
    # No second buffer: the sum is x's storage; the residual stream it came from is untouched.
    assert summed.data_ptr() == x.data_ptr()
    assert torch.equal(residual, residual_before)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@needs_kernels
def test_a_strided_x_still_gets_a_buffer_of_its_own() -> None:
    norm = RMSNorm(64, 1e-6)
    wide = torch.randn(5, 128)
    x, residual = wide[:, :64], torch.randn(5, 64)
    out, summed = norm.add_forward(x, residual)
    assert summed.data_ptr() != wide.data_ptr()
    assert torch.equal(summed, wide[:, :64] + residual)
