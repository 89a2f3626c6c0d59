"""The CPU GEMV over quantized weights (csrc/qgemv.c) equals the dequantized weight's matmul,
for each kind of code (4-bit, 8-bit, fp8 e4m3 including its subnormals and signs), and a decode
step takes it instead of dequantizing a float copy of the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv, matmul
from minisgl.quant.qtensor import FP8, QTensor, dequantize, pack_nibbles
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")

N, K = 96, 512


def _weights() -> dict[str, QTensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    out = {m: quantize(w, load_scheme(m)) for m in ("int8", "int4", "fp8")}
    # Every e4m3 byte but NaN (0x7F, 0xFF), subnormals and negative zero included.
    codes = torch.arange(256, dtype=torch.uint8).repeat(N * K // 256).view(N, K)
    codes[codes % 128 == 127] = 0
    out["fp8 all codes"] = QTensor(codes.view(FP8), torch.rand(N, 4) + 0.5, None, None, 8, 128, K)
    # 4-bit, group 64 with random zero points (AWQ/GPTQ-like).
    q = torch.randint(0, 16, (N, K), generator=g)
    zeros = torch.randint(0, 16, (N, K // 64), generator=g).to(torch.uint8)
    out["int4 g64"] = QTensor(pack_nibbles(q), torch.rand(N, K // 64), zeros, None, 4, 64, K)
    return out


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_the_dequantized_matmul(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for name, w in _weights().items():
        assert cpu_gemv.usable(x, w), name
        ours = cpu_gemv.qgemv(x, w)
        deq = dequantize(w, torch.float32)
        ref = F.linear(x.float(), deq)
        assert ours.dtype == dtype
        # Another summation order: off by rounding, relative to the size of the terms summed.
        terms = F.linear(x.float().abs(), deq.abs())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert bool(((ours.float() - ref).abs() <= tol * terms + 1e-6).all()), name


def test_decode_reads_the_codes_not_a_dequantized_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weights()["int4"]

    def no_copy(*a, **k):
        raise AssertionError("dequantized a float copy for a decode-sized input")

    monkeypatch.setattr(matmul, "dequantize", no_copy)
    matmul.qlinear(torch.randn(1, K), w)
    with pytest.raises(AssertionError, match="float copy"):
        matmul.qlinear(torch.randn(cpu_kernels.MAX_ROWS + 1, K), w)  # prefill: dequantized


def test_a_source_added_to_the_build_is_a_new_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached library is keyed by the sources it compiles, not only by csrc's contents: a
    file added to the list (as qgemv.c was, while a build without it sat in the cache under
    the same contents) must not be served the old library, which lacks its functions."""
    from minisgl.layers import cpu_build

    before = cpu_build.source_digest("avx2", ["-mavx2"])
    monkeypatch.setattr(cpu_build, "COMMON_SOURCES", cpu_build.COMMON_SOURCES[:-1])
    assert cpu_build.source_digest("avx2", ["-mavx2"]) != before
