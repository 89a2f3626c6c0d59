"""A quantized weight's C-call arguments (pointers, strides, sizes) are built once per QTensor
and reused by every decode-step call (cpu_gemv.operands), yet never outlive the tensors they
point into: a replaced tensor or a storage swapped in place (hugepages.move_onto) rebuilds
them. A wrong K is refused where it costs one comparison."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv, cpu_panel
from minisgl.quant.qtensor import QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


def _weight(seed: int, method: str = "int4") -> QTensor:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    return quantize(w, load_scheme(method))


def _reference(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    return x @ dequantize(w, torch.float32).T


def _check(y: torch.Tensor, x: torch.Tensor, w: QTensor) -> None:
    """Within x's int16 rounding (integer codes) of w's product; another weight's is ~10 off."""
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-2, atol=0.1)


def test_the_arguments_are_built_once_per_weight() -> None:
    w = _weight(0)
    x = torch.randn(1, 256)
    cpu_gemv.qgemv(x, w)
    ops = cpu_gemv.operands(w)
    cpu_gemv.qgemv(x, w)
    assert cpu_gemv.operands(w) is ops


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_the_arguments_follow_replaced_and_moved_tensors(method: str) -> None:
    w, other = _weight(0, method), _weight(1, method)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    _check(cpu_gemv.qgemv(x, w), x, w)
    # Another shard's tensors put in (a QTensor is mutable).
    w.codes, w.scales, w.zeros = other.codes.clone(), other.scales.clone(), other.zeros
    _check(cpu_gemv.qgemv(x, w), x, other)
    # Storage swapped under the same tensors, as hugepages.move_onto does; the old freed.
    fresh = _weight(2, method)
    w.codes.data = fresh.codes.clone()
    w.scales.data = fresh.scales.clone()
    if w.zeros is not None and fresh.zeros is not None:
        w.zeros.data = fresh.zeros.clone()
    _check(cpu_gemv.qgemv(x, w), x, fresh)
    rows = cpu_gemv.dequant_rows(w, 3, 5)
    assert torch.equal(rows, dequantize(fresh, torch.float32)[3:5])


def test_a_wrong_k_is_refused() -> None:
    w = _weight(0)
    x = torch.randn(1, 512)  # twice the weight's K: the kernel would read half of each row
    with pytest.raises(ValueError, match="K = 256"):
        cpu_gemv.qgemv(x, w)
    with pytest.raises(ValueError, match="K = 256"):
        cpu_panel.dequant_panel(x, w)
