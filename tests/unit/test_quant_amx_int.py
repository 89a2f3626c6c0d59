"""The AMX-INT8 matmul over integer codes (csrc/qamxi.c): x quantized per row to int16 as the
decode GEMV does, the codes multiplied straight as tiles. Equal to the dequantized weight's
matmul on that x to fp32 rounding for 8-bit and 4-bit codes, groups of 32, 64, 128 and whole
rows, row counts around the 16-row tiles, odd N (a last short item), a tensor-parallel
shard's strided codes, one thread and two to the bit; fp8 codes with fp32 x and builds
without AMX-INT8 run qgemv (fp8 with bf16 x: test_quant_amx_fp8.py); the chooser's untuned
picks name it only where it runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.cpu_panel import amx_int
from minisgl.quant.qtensor import QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.testing import builds
from minisgl.testing.threads import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")

_AMXI = bool((lib := cpu_kernels.load()) is not None and "u8" in lib.qamxi)


def _weight(method: str, group: int | None, n: int, k: int, seed: int) -> QTensor:
    s = load_scheme(method)
    s = s if group is None else dataclasses.replace(s, group_size=group)
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), s)


def _check(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """amx_int(x, w) against the exact product of x as quantized (int16 per row) and the
    dequantized weight; returns the result."""
    assert cpu_gemv.usable(x, w)
    deq = dequantize(w, torch.float32).double()
    xf = x.float()
    step = xf.abs().amax(dim=1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xf * (1 / step)).clamp(-32767, 32767) * step
    ours = amx_int(x, w, torch.float32)
    ref = F.linear(xq.double(), deq)
    # exact integer sums, fp32 rounding where they become floats and meet the scales; a tie
    # x * (1 / step) may round the other way: one step of one feature
    tol = 1e-5 * F.linear(xq.double().abs(), deq.abs()) + step.double() * deq.abs().amax(dim=1)
    assert ours.shape == ref.shape
    assert bool(((ours.double() - ref).abs() <= tol).all())
    return ours


@pytest.mark.skipif(not _AMXI, reason="no AMX-INT8 tiles on this CPU or build (qamxi.c)")
@pytest.mark.parametrize(
    "method,group,n,k",
    [
        ("int8", None, 37, 1024),  # per row: chunks of 128 within one group
        ("int8", None, 33, 96),  # per row, K not a multiple of 64: 32-feature steps
        ("int8", 32, 48, 256),
        ("int4", 32, 37, 256),
        ("int4", 64, 50, 384),
        ("int4", 128, 65, 640),
        ("int4", 160, 32, 320),  # a group of 128 + 32: a chunk, then a 32-feature step
    ],
)
def test_equals_the_dequantized_matmul_on_int16_x(
    method: str, group: int | None, n: int, k: int
) -> None:
    w = _weight(method, group, n, k, n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 7, 8, 9, 16, 17, 64):
        x = torch.randn(rows, k, generator=g).bfloat16()
        outs = at_thread_counts(lambda: _check(x, w))  # noqa: B023 (called at once)
        assert torch.equal(outs[0], outs[1])  # every output summed in one order


@pytest.mark.skipif(not _AMXI, reason="no AMX-INT8 tiles on this CPU or build (qamxi.c)")
def test_fp32_in_bf16_out_and_a_shard() -> None:
    """fp32 x, bf16 outputs (qgemv's rounding), and a tensor-parallel shard's codes and scales
    at the full row's strides."""
    full = _weight("int4", 128, 64, 1024, 5)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(5))
    for part in (full.narrow(0, 16, 33), full.narrow(1, 512, 512)):
        _check(x[:, : part.in_features], part)
    x = x[:, :512]
    w = _weight("int8", None, 40, 512, 6)
    out = amx_int(x, w)
    assert out.dtype == torch.float32
    xb = x.bfloat16()
    assert torch.equal(amx_int(xb, w), amx_int(xb, w, torch.float32).bfloat16())


def test_fp8_codes_with_fp32_x_run_qgemv() -> None:
    """fp8 codes against fp32 x (which bf16 tiles would round): amx_int is the decode GEMV,
    here or anywhere (bf16 x: test_quant_amx_fp8.py)."""
    w = _weight("fp8", 128, 40, 256, 7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    assert torch.equal(amx_int(x, w), cpu_gemv.qgemv(x, w))


def test_chooser_names_it_for_few_rows_only_where_it_runs() -> None:
    """A candidate; the untuned picks run it for 2-16 rows where AMX-INT8 runs, qgemv for one
    row (and for all few rows elsewhere), and a kernel whose picks name it runs it."""
    assert "amx_int" in cpu_choice.CANDIDATES
    picks = cpu_choice.default_picks()
    assert picks[0] == "qgemv"
    assert set(picks[1:4]) == {"amx_int" if _AMXI else "qgemv"}
    w = _weight("int8", 64, 48, 256, 8)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(8))
    expect = amx_int(x, w) if _AMXI else cpu_gemv.qgemv(x, w)
    assert torch.equal(cpu_choice.QuantKernel(picks)(x, w), expect)


def test_untuned_picks_name_what_runs_fp8_weights() -> None:
    """The untuned picks of fp8 weights name amx_int for few rows where its AMX-BF16 kernel
    runs and x is bf16, qgemv otherwise (what runs them); integer codes amx_int where AMX-INT8
    runs: the start-up log says which kernel runs."""
    fp8 = _weight("fp8", 128, 48, 256, 9)
    int8 = _weight("int8", None, 48, 256, 9)
    fp8_tiles = "amx_int" if lib is not None and "fp8" in lib.qamxi else "qgemv"
    # AVX512-BF16 without AMX (Zen 4): the bf16 panel from 5 rows (test_quant_panel.py)
    bf16_panel = lib is not None and bool(lib.qamx) and not lib.qamxi
    picks, _ = cpu_choice.choose([fp8], torch.bfloat16, "off") or ((), "")
    want = ("amx_panel",) * 2 if bf16_panel else (fp8_tiles,) * 2
    assert picks[:4] == ("qgemv", fp8_tiles, *want)
    picks, _ = cpu_choice.choose([fp8], torch.float32, "off") or ((), "")
    assert picks[:4] == ("qgemv",) * 4
    picks, _ = cpu_choice.choose([int8], torch.bfloat16, "off") or ((), "")
    assert picks[1:4] == ("amx_int" if _AMXI else "qgemv",) * 3


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_builds_without_amx_and_exports_nothing(tmp_path: Path, isa: str) -> None:
    """The AVX2 build and an AVX-512 build without AMX compile qamxi.c, with no entry points
    (cpu_kernels then offers no qamxi and amx_int runs qgemv)."""
    lib = builds.without_amx("qamxi.c", isa, tmp_path)
    if lib is None:
        pytest.skip("no C compiler here")
    assert getattr(lib, "qamxi_ready", None) is None
    assert getattr(lib, "qamxi_u8", None) is None
