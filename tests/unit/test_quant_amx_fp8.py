"""fp8 e4m3 weights on AMX-BF16 tiles for few rows (csrc/qamxf.c, the amx_int candidate's fp8
kernel): each code converted exactly to bf16, bf16 x, each group's fp32 sum times its scale.
Equal to the dequantized weight's matmul to fp32 rounding for 128x128 block scales and one
scale per row (per channel, and per tensor, which loads as that), groups of 32 and 64, row
counts 1 to 16 and past the 16-row slabs, N not a multiple of the 32-row items, K not a
multiple of 64; every e4m3 byte but NaN; a shard's strided codes; one thread and two to the
bit; the chooser's untuned pick for 2-16 rows where it runs; builds without AMX compile it
with no entry points."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.cpu_panel import amx_int
from minisgl.quant.qtensor import FP8, QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.testing import builds
from minisgl.testing.threads import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")

_FP8 = bool((lib := cpu_kernels.load()) is not None and "fp8" in lib.qamxi)
needs_tiles = pytest.mark.skipif(
    not _FP8, reason="no AMX-BF16 tiles (or AVX512-VBMI) on this CPU or build (qamxf.c)"
)


def _weight(group: int, n: int, k: int, seed: int) -> QTensor:
    """fp8 with 128x128 block scales (group 128), other square blocks, or one scale per row
    (group 0)."""
    s = dataclasses.replace(load_scheme("fp8"), group_size=group)
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), s)


def _check(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """amx_int(x, w) against the dequantized weight's matmul (float64); returns the result."""
    assert cpu_gemv.usable(x, w)
    deq = dequantize(w, torch.float32).double()
    ours = amx_int(x, w, torch.float32)
    ref = F.linear(x.double(), deq)
    # the products exact, fp32 sums per group, each times its scale once in fp32
    tol = 1e-5 * F.linear(x.double().abs(), deq.abs())
    assert ours.shape == ref.shape
    assert bool(((ours.double() - ref).abs() <= tol).all())
    return ours


@needs_tiles
@pytest.mark.parametrize(
    "group,n,k",
    [
        (128, 256, 1024),  # Qwen's 128x128 blocks
        (128, 37, 384),  # a last, short item of rows
        (0, 128, 512),  # one scale per row (per channel; per tensor loads as that)
        (0, 45, 96),  # K not a multiple of 64: a 32-feature block
        (64, 40, 320),
        (32, 33, 160),  # groups of 32: every block half empty
    ],
)
def test_equals_the_dequantized_matmul(group: int, n: int, k: int) -> None:
    w = _weight(group, n, k, n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 5, 8, 13, 16, 17, 40):
        x = torch.randn(rows, k, generator=g).bfloat16()
        outs = at_thread_counts(lambda: _check(x, w))  # noqa: B023 (called at once)
        assert torch.equal(outs[0], outs[1])  # every output summed in one order


@needs_tiles
def test_every_code_bf16_out_and_a_shard() -> None:
    """Every e4m3 byte but NaN (subnormals, negative zero); bf16 outputs (the fp32 result
    rounded once); a tensor-parallel shard's codes and scales at the full row's strides."""
    n, k = 48, 512
    codes = torch.arange(256, dtype=torch.uint8).repeat(n * k // 256).view(n, k)
    codes[codes % 128 == 127] = 0
    every = QTensor(codes.view(FP8), torch.rand(n, 1) + 0.5, None, None, 8, 0, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    _check(x, every)
    assert torch.equal(amx_int(x, every), amx_int(x, every, torch.float32).bfloat16())
    full = _weight(128, 96, 1024, 5)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(2)).bfloat16()
    for part in (full.narrow(0, 16, 48), full.narrow(1, 512, 512)):
        _check(x[:, : part.in_features].contiguous(), part)


def test_untuned_pick_for_few_rows_where_it_runs() -> None:
    """amx_int is the untuned pick of fp8 weights for 2-16 bf16 rows where the tiles run (qgemv
    elsewhere and for one row; from 5 rows the bf16 panel where it runs on AVX512-BF16
    without AMX: test_quant_panel.py), and a kernel whose picks name it runs it."""
    w = _weight(128, 64, 256, 8)
    picks, _ = cpu_choice.choose([w], torch.bfloat16, "off") or ((), "")
    assert picks[0] == "qgemv"
    lib = cpu_kernels.load()
    bf16_panel = lib is not None and bool(lib.qamx) and not lib.qamxi
    assert set(picks[1:2]) == {"amx_int" if _FP8 else "qgemv"}
    assert set(picks[2:4]) == {"amx_panel" if bf16_panel else "amx_int" if _FP8 else "qgemv"}
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    expect = amx_int(x, w) if _FP8 else cpu_gemv.qgemv(x, w)
    assert torch.equal(cpu_choice.QuantKernel(picks)(x, w), expect)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_builds_without_amx_and_exports_nothing(tmp_path: Path, isa: str) -> None:
    """The AVX2 build and an AVX-512 build without AMX compile qamxf.c, with no entry points
    (cpu_kernels then offers no fp8 tiles and amx_int runs qgemv for fp8)."""
    lib = builds.without_amx("qamxf.c", isa, tmp_path)
    if lib is None:
        pytest.skip("no C compiler here")
    assert getattr(lib, "qamxf_ready", None) is None
    assert getattr(lib, "qamxf_fp8", None) is None
