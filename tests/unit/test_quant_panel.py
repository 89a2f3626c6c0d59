"""The many-row matmul over quantized weights (csrc/qdequant.c) equals the dequantized weight's
matmul to fp32 rounding: every code kind (4-bit, 8-bit, fp8 e4m3 with its subnormals and
signs), groups of 32, 64, 128 and whole rows, odd row counts, K across the kernel's chunk and
segment edges, output rows past a multiple of 16, a tensor-parallel shard's strided codes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.cpu_panel import dequant_panel
from minisgl.quant.qtensor import FP8, QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


def _scheme(method: str, group: int | None):  # noqa: ANN202
    s = load_scheme(method)
    return s if group is None else dataclasses.replace(s, group_size=group)


def _check(x: torch.Tensor, w: QTensor) -> None:
    assert cpu_gemv.usable(x, w)
    ours = dequant_panel(x, w, torch.float32)
    deq = dequantize(w, torch.float32)
    ref = F.linear(x.float(), deq)
    # Another summation order: off by fp32 rounding of the terms summed, nothing more (the
    # weights are the dequantized ones exactly, x is multiplied as it is).
    terms = F.linear(x.float().abs(), deq.abs())
    assert ours.shape == ref.shape
    assert bool(((ours - ref).abs() <= 1e-5 * terms + 1e-30).all())


# (method, group) x (N, K): K below one tile chunk, across chunks (256), across the 2048-feature
# segment; N not a multiple of 16.
@pytest.mark.parametrize(
    "method,group",
    [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", 32), ("fp8", 64)]
    + [("fp8", 128)],
)
@pytest.mark.parametrize("n,k", [(37, 128), (16, 768), (20, 2048 + 384)])
def test_panel_equals_the_dequantized_matmul(method: str, group: int | None, n: int, k: int):
    g = torch.Generator().manual_seed(n + k)
    w = quantize(torch.randn(n, k, generator=g), _scheme(method, group))
    for rows in (1, 5, 23):
        _check(torch.randn(rows, k, generator=g), w)


def test_fp8_every_code_and_bf16_in_and_out() -> None:
    """Every e4m3 byte but NaN (subnormals, negative zero), one scale per row (group 0), and
    bf16 activations and outputs as a bf16 model passes them."""
    n, k = 48, 512
    codes = torch.arange(256, dtype=torch.uint8).repeat(n * k // 256).view(n, k)
    codes[codes % 128 == 127] = 0
    w = QTensor(codes.view(FP8), torch.rand(n, 1) + 0.5, None, None, 8, 0, k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(1))
    _check(x, w)
    xb = x.bfloat16()
    out = dequant_panel(xb, w)
    assert out.dtype == torch.bfloat16
    deq = dequantize(w, torch.float32)
    ref = F.linear(xb.float(), deq)
    terms = F.linear(xb.float().abs(), deq.abs())
    # fp32 sums rounded once to bf16 (half a unit in the last place: at most 2^-8 relative)
    assert bool(((out.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-5 * terms).all())


def test_shard_of_rows_and_of_input_features() -> None:
    """A tensor-parallel shard reads codes at the full row's stride and its groups' scales at
    the full row's group stride."""
    g = torch.Generator().manual_seed(2)
    for method in ("int8", "int4", "fp8"):
        full = quantize(torch.randn(64, 1024, generator=g), _scheme(method, 128))
        for part in (full.narrow(0, 16, 33), full.narrow(1, 512, 512)):
            _check(torch.randn(9, part.in_features, generator=g), part)


def test_chooser_runs_it_for_many_rows() -> None:
    """A candidate of the quantized chooser: a kernel whose picks name it runs it."""
    assert "dequant_panel" in cpu_choice.CANDIDATES
    w = quantize(
        torch.randn(64, 256, generator=torch.Generator().manual_seed(3)), _scheme("int4", 64)
    )
    kernel = cpu_choice.QuantKernel(["dequant_panel"] * 6)
    x = torch.randn(70, 256)
    assert torch.equal(kernel(x, w), dequant_panel(x, w))
