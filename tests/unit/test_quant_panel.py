"""The many-row matmuls over quantized weights (csrc/qdequant.c) equal the dequantized weight's
matmul to fp32 rounding: every code kind (4-bit, 8-bit, fp8 e4m3 with its subnormals and
signs), groups of 32, 64, 128 and whole rows, odd row counts, K across the kernels' chunk,
run and segment edges, output rows past a multiple of 16, a tensor-parallel shard's strided
codes; the int16 one on x as it quantizes it (per row to int16, as the decode GEMV)."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_build, cpu_kernels, kernel_choice
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.cpu_panel import amx_panel, dequant_panel, int16_panel
from minisgl.quant.qtensor import FP8, QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.testing.threads import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


def _scheme(method: str, group: int | None):  # noqa: ANN202
    s = load_scheme(method)
    return s if group is None else dataclasses.replace(s, group_size=group)


def _int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the int16 kernel multiplies it (scale max|x| / 32767 per row, nearest integer),
    and the step of those integers per row."""
    xf = x.float()
    step = xf.abs().amax(dim=1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.round(xf * (1 / step)).clamp(-32767, 32767) * step, step


def _check(x: torch.Tensor, w: QTensor) -> None:
    assert cpu_gemv.usable(x, w)
    deq = dequantize(w, torch.float32)
    ours = dequant_panel(x, w, torch.float32)
    ref = F.linear(x.float(), deq)
    # Another summation order: off by fp32 rounding of the terms summed, nothing more (the
    # weights are the dequantized ones exactly, x is multiplied as it is).
    terms = F.linear(x.float().abs(), deq.abs())
    assert ours.shape == ref.shape
    assert bool(((ours - ref).abs() <= 1e-5 * terms + 1e-30).all())
    ours16 = int16_panel(x, w, torch.float32)
    if w.codes.dtype == FP8:  # no integer form: the fp32 kernel
        assert torch.equal(ours16, ours)
        return
    xq, step = _int16(x)
    ref16 = F.linear(xq.double(), deq.double()).float()
    # exact integer sums, fp32 rounding in the scales; a tie x * (1 / step) may round the
    # other way: one step of one feature
    tol = 1e-5 * F.linear(xq.abs(), deq.abs()) + step * deq.abs().amax(dim=1)
    assert bool(((ours16 - ref16).abs() <= tol).all())


# Each group size with each code kind; K below one tile chunk (128), across chunks (768), across
# the 2048-feature segment (2432); N not a multiple of 16.
@pytest.mark.parametrize(
    "method,group,n,k",
    [
        ("int8", None, 37, 128),
        ("int8", None, 20, 2048 + 384),
        ("int4", 32, 16, 768),
        ("int4", 64, 37, 128),
        ("int4", 128, 20, 2048 + 384),
        ("fp8", 32, 37, 128),
        ("fp8", 64, 16, 768),
        ("fp8", 128, 20, 2048 + 384),
    ],
)
def test_panel_equals_the_dequantized_matmul(method: str, group: int | None, n: int, k: int):
    g = torch.Generator().manual_seed(n + k)
    w = quantize(torch.randn(n, k, generator=g), _scheme(method, group))
    for rows in (1, 5, 23):
        _check(torch.randn(rows, k, generator=g), w)


def _every_fp8_code(n: int = 48, k: int = 512) -> QTensor:
    """An fp8 [n, k] weight holding every e4m3 byte but NaN (subnormals, negative zero), one
    scale per row (group 0)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(n * k // 256).view(n, k)
    codes[codes % 128 == 127] = 0
    return QTensor(codes.view(FP8), torch.rand(n, 1) + 0.5, None, None, 8, 0, k)


def test_fp8_every_code_and_bf16_in_and_out() -> None:
    """Every e4m3 byte but NaN (subnormals, negative zero), one scale per row (group 0), and
    bf16 activations and outputs as a bf16 model passes them."""
    w = _every_fp8_code()
    x = torch.randn(13, w.in_features, generator=torch.Generator().manual_seed(1))
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
    assert {"dequant_panel", "int16_panel"} <= set(cpu_choice.CANDIDATES)
    w = quantize(
        torch.randn(64, 256, generator=torch.Generator().manual_seed(3)), _scheme("int4", 64)
    )
    kernel = cpu_choice.QuantKernel(["dequant_panel"] * len(kernel_choice.BUCKETS))
    x = torch.randn(70, 256)
    assert torch.equal(kernel(x, w), dequant_panel(x, w))


_AMX = bool((lib := cpu_kernels.load()) is not None and lib.qamx)


@pytest.mark.skipif(not _AMX, reason="no AMX tiles or AVX512-BF16 on this CPU or build (qamx.c)")
@pytest.mark.parametrize(
    "method,group,n,k",
    [("int8", None, 37, 1024), ("int4", 128, 101, 640), ("fp8", 128, 45, 2048 + 384)],
)
def test_amx_panel_equals_the_bf16_dequantized_matmul(
    method: str, group: int | None, n: int, k: int
) -> None:
    """On AMX: the dequantized weight rounded once to bf16 (what a bf16 twin of the model
    holds), multiplied by bf16 x with fp32 sums; every row count around the 16-row tiles and
    32-row blocks, odd N (a panel's rows past N), one thread and all of them to the bit."""
    g = torch.Generator().manual_seed(n + k)
    w = quantize(torch.randn(n, k, generator=g), _scheme(method, group))
    deq = dequantize(w, torch.float32).bfloat16().double()
    for rows in (1, 2, 8, 16, 17, 64, 300):
        x = torch.randn(rows, k, generator=g).bfloat16()
        ref = F.linear(x.double(), deq)
        terms = F.linear(x.double().abs(), deq.abs())
        outs = at_thread_counts(lambda: amx_panel(x, w, torch.float32))  # noqa: B023
        assert torch.equal(outs[0], outs[1])
        # products exact in fp32, sums in fp32: a few units of fp32 rounding of the terms
        assert bool(((outs[0].double() - ref).abs() <= 1e-6 * terms + 1e-30).all())
        out_bf16 = amx_panel(x, w)
        assert out_bf16.dtype == torch.bfloat16
        assert torch.equal(out_bf16, outs[0].bfloat16())


@pytest.mark.skipif(not _AMX, reason="no AMX tiles or AVX512-BF16 on this CPU or build (qamx.c)")
def test_amx_panel_reads_a_shard_and_every_fp8_code() -> None:
    """A tensor-parallel shard's strided codes and group scales; every e4m3 byte but NaN."""
    g = torch.Generator().manual_seed(5)
    full = quantize(torch.randn(64, 1024, generator=g), _scheme("int4", 128))
    every = _every_fp8_code()
    for w in (full.narrow(0, 16, 33), full.narrow(1, 512, 512), every):
        x = torch.randn(19, w.in_features, generator=g).bfloat16()
        deq = dequantize(w, torch.float32).bfloat16().double()
        ref = F.linear(x.double(), deq)
        terms = F.linear(x.double().abs(), deq.abs())
        out = amx_panel(x, w, torch.float32).double()
        assert bool(((out - ref).abs() <= 1e-6 * terms + 1e-30).all())


def test_amx_panel_is_a_candidate_and_fp32_x_takes_the_fp32_panel() -> None:
    """fp32 activations (which bf16 tiles would round) run dequant_panel, here or anywhere;
    the untuned picks run it for many rows where AMX runs."""
    assert "amx_panel" in cpu_choice.CANDIDATES
    g = torch.Generator().manual_seed(6)
    w = quantize(torch.randn(40, 256, generator=g), _scheme("int4", 64))
    x = torch.randn(33, 256, generator=g)
    assert torch.equal(amx_panel(x, w), dequant_panel(x, w))
    picks = cpu_choice.default_picks()
    assert picks[-1] == ("amx_panel" if _AMX else "dequant_panel")
    assert torch.equal(cpu_choice.QuantKernel(picks)(x, w), dequant_panel(x, w))


def test_untuned_picks_take_the_bf16_panel_for_fewer_rows_without_amx() -> None:
    """Where the bf16 panel runs on AVX512-BF16 without AMX tiles (AMD Zen 4), the untuned
    picks run fp8 codes on it from 5 rows and 4-bit codes from 9 (faster there than the
    GEMV's conversions), 8-bit codes and fp32 x on the GEMV up to 16 rows; elsewhere the GEMV
    (or AMX's tiles) up to 16 rows as before."""
    g = torch.Generator().manual_seed(8)
    lib = cpu_kernels.load()
    zen4 = lib is not None and bool(lib.qamx) and not lib.qamxi
    weights = {
        m: quantize(torch.randn(32, 256, generator=g), load_scheme(m))
        for m in ("int8", "int4", "fp8")
    }
    for method, first in (("fp8", 5), ("int4", 9), ("int8", 17)):
        picks, _ = cpu_choice.choose([weights[method]], torch.bfloat16, "off") or ((), "")
        for (lo, hi), pick in zip(kernel_choice.BUCKETS, picks, strict=True):
            if zen4 and lo >= first:
                assert pick == "amx_panel", (method, lo, picks)
            elif hi is not None and hi <= 16:
                assert pick in ("qgemv", "amx_int"), (method, lo, picks)
        fp32, _ = cpu_choice.choose([weights[method]], torch.float32, "off") or ((), "")
        assert all(p in ("qgemv", "amx_int") for p in fp32[:4]), (method, fp32)
        x = torch.randn(6, 256, generator=g).bfloat16()  # bucket 5-8: what the pick runs
        got = cpu_choice.QuantKernel(picks)(x, weights[method])
        assert torch.equal(got, cpu_choice._RUN[picks[2]](x, weights[method])), method


@pytest.mark.parametrize(
    "isa,extra,exports",
    [("avx2", (), False), ("avx512", (), False), ("avx512", ("avx512_bf16",), True)],
)
def test_qamx_builds_without_amx(
    tmp_path: Path, isa: str, extra: tuple[str, ...], exports: bool
) -> None:
    """qamx.c compiles into every build. Without AMX tiles and without AVX512-BF16 it has no
    entry points (cpu_kernels then offers no bf16 panel and amx_panel runs dequant_panel); an
    AVX-512 build with AVX512-BF16 but no AMX (AMD Zen 4) has the VDPBF16PS panel, so that
    the chooser can pick it for prefill there."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    flags = frozenset({"avx2", "fma", *extra}) | (
        cpu_build.AVX512_NEEDS if isa == "avx512" else frozenset()
    )
    lib_path = tmp_path / f"qamx-{isa}.so"
    cflags = cpu_build.compile_flags(isa, flags)
    assert cpu_build._compile(cc, cflags, [cpu_build.CSRC / "qamx.c"], tmp_path, lib_path) is None
    lib = ctypes.CDLL(str(lib_path))
    for name in ("qamx_ready", "qamx_u8", "qamx_u4", "qamx_fp8"):
        assert (getattr(lib, name, None) is not None) == exports, name
