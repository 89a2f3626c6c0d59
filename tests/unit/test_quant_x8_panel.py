"""x8_panel (qvnni.c): many rows of x rounded to 8 bits per row and block of features against
8- and 4-bit integer codes (--cpu-quantized-activations int8 for prefill and big batches).
Checked against a torch emulation of the same quantization (x to int8 per row and block with
its own scale, exact integer sums, then the fold) to fp32 rounding; the chooser offers it
only under int8 activations. On a build without AVX512-VNNI (no qvnni.c) x8_panel runs the
exact panel and the chooser never offers it: the same tests check that instead."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import cpu_kernels, kernel_choice
from minisgl.quant import cpu_choice, cpu_panel
from minisgl.quant.qtensor import QTensor, dequantize, unpack_nibbles
from minisgl.testing.qtensors import random_qtensor
from minisgl.testing.threads import at_thread_counts

K = 512


def _block(w: QTensor) -> int:
    gs = w.group_size or w.in_features
    return next(b for b in (128, 64, 32) if gs % b == 0)


def _emulate(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x rounded to int8 per row and block (scale max|x| / 127, x times its inverse in fp32,
    nearest even), the integer sums exact (float64), folded per block in float64."""
    m, k = x.shape
    b = _block(w)
    xb = x.float().view(m, k // b, b)
    amax = xb.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xb * (1.0 / s)[..., None]).clamp(-127, 127).double()
    codes = unpack_nibbles(w.codes) if w.bits == 4 else w.codes
    acc = torch.einsum("mbk,nbk->mnb", q, codes.double().view(-1, k // b, b))
    group = torch.arange(k // b) * b // (w.group_size or k)
    z, sw = w.zeros.double()[:, group], w.scales.double()[:, group]
    t = acc - z[None] * q.sum(-1)[:, None, :]
    return (t * sw[None] * s.double()[:, None, :]).sum(-1)


FORMATS = [(8, 0), (4, 128), (4, 64), (4, 32)]


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 17, 64, 130, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_emulation_at_one_and_two_threads(
    bits: int, group: int, rows: int, dtype: torch.dtype
) -> None:
    w = random_qtensor(100, K, bits, group)  # N not a multiple of the 48-row panel
    x = (torch.randn(rows, K) * torch.rand(rows, 1) * 4).to(dtype)
    outs = at_thread_counts(lambda: cpu_panel.x8_panel(x, w, torch.float32))
    if not cpu_panel.x8_takes(w):  # no qvnni.c here: the exact bf16/fp32 panel
        want = cpu_panel.amx_panel(x, w, torch.float32)
        assert all(torch.equal(y, want) for y in outs)
        return
    ref = _emulate(x, w)
    tol = 2e-6 * ref.abs().amax().item()
    for y in outs:
        assert (y.double() - ref).abs().max().item() <= tol
    assert torch.equal(outs[0], outs[1])  # a row's sums do not depend on the thread count


def test_a_thousand_outputs_in_bf16_and_the_error_against_exact() -> None:
    """N = 1000 (20 panels and a partial one), bf16 out: the emulation rounded once to bf16;
    against the exact matmul on the dequantized weight, x8's usual error (~0.6%)."""
    w = random_qtensor(1000, 1024, 4, 128, seed=1)
    x = torch.randn(130, 1024).to(torch.bfloat16)
    y = cpu_panel.x8_panel(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (130, 1000)
    if not cpu_panel.x8_takes(w):
        assert torch.equal(y, cpu_panel.amx_panel(x, w))
        return
    ref = _emulate(x, w)
    assert (y.double() - ref).abs().max().item() <= 2**-7 * ref.abs().amax().item()
    exact = x.double() @ dequantize(w, torch.float32).double().T
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.015  # rounded (not exact), and by 8-bit x's usual amount


def test_declines_what_it_cannot_take() -> None:
    """fp8 codes, scattered groups and K not a multiple of 64: x8_takes says no (x8_panel then
    runs the exact panel)."""
    fp8 = QTensor(
        torch.zeros(16, K, dtype=torch.float8_e4m3fn),
        torch.ones(16, K // 128),
        None,
        None,
        8,
        128,
        K,
    )
    assert not cpu_panel.x8_takes(fp8)
    odd = random_qtensor(16, 96, 4, 32)
    assert not cpu_panel.x8_takes(odd)
    x = torch.randn(70, 96).to(torch.bfloat16)
    assert torch.equal(cpu_panel.x8_panel(x, odd), cpu_panel.amx_panel(x, odd))
    w = random_qtensor(16, K, 4, 128)
    scattered = QTensor(
        w.codes, w.scales, w.zeros, torch.arange(K, dtype=torch.int32) // 128, 4, 128, K
    )
    assert not cpu_panel.x8_takes(scattered)


def _has_kernel() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.qvnni)


def test_the_chooser_offers_it_only_under_int8_activations() -> None:
    """Under --cpu-quantized-activations int8 the chooser times x8_panel and its defaults take
    it for prefill; in the exact mode it is never timed nor picked (it would change the
    numerics)."""
    w = random_qtensor(96, K, 4, 128)
    assert "x8_panel" not in cpu_choice.offered([w])
    assert "x8_panel" not in cpu_choice.default_picks("u4", torch.bfloat16, False)
    cpu_kernels.set_quantized_activations("int8")
    try:
        offered = cpu_choice.offered([w])
        picks, _ = cpu_choice.choose([w], torch.bfloat16, "off") or ((), "")
    finally:
        cpu_kernels.set_quantized_activations("int16")
    prefill = kernel_choice.bucket_of(512)
    if _has_kernel():
        assert "x8_panel" in offered
        assert picks[prefill] == "x8_panel"
        assert cpu_kernels.int8_activation_rows() >= 512
    else:
        assert "x8_panel" not in offered and "x8_panel" not in picks
    picks, _ = cpu_choice.choose([w], torch.bfloat16, "off") or ((), "")
    assert "x8_panel" not in picks


def test_timing_passes_run_it_only_under_int8_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() runs the offered candidates only: outside int8 activations x8_panel's
    timings are None and it never ran."""
    ran: list[str] = []
    for name in cpu_choice.CANDIDATES:
        real = cpu_choice._RUN[name]
        monkeypatch.setitem(
            cpu_choice._RUN, name, lambda x, w, o=None, n=name, r=real: ran.append(n) or r(x, w)
        )
    monkeypatch.setattr(cpu_choice, "_MAX_REPEATS", 1)
    monkeypatch.setattr(kernel_choice, "TIMED_ROWS", (1, 4, 8, 16, 32, 64, 80, 96))
    monkeypatch.setattr(cpu_choice, "TIMED_ROWS", (1, 4, 8, 16, 32, 64, 80, 96))
    w = random_qtensor(48, 256, 4, 128)
    timings = cpu_choice.measure([w], torch.bfloat16, names=cpu_choice.offered([w]))
    assert "x8_panel" not in ran and all(t is None for t in timings["x8_panel"])
    cpu_kernels.set_quantized_activations("int8")
    try:
        timings = cpu_choice.measure([w], torch.bfloat16, names=cpu_choice.offered([w]))
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert ("x8_panel" in ran) == _has_kernel()


def test_the_decode_chain_runs_the_pick_as_one_call() -> None:
    """A decode batch whose pick is x8_panel (4-bit codes from 5 rows under int8 activations)
    stays in the C decode chain: the pick is qvnni.c's entry point (before, the chain gave up
    on it and the whole step ran layer by layer)."""
    lib = cpu_kernels.load()
    assert lib is not None
    for kind in ("u4", "u8"):
        if kind in lib.qvnni:
            assert cpu_choice.kernel_fn(lib, "x8_panel", kind, 1) is lib.qvnni[kind]
        else:  # no single call: the chain leaves the step to the layer-by-layer path
            assert cpu_choice.kernel_fn(lib, "x8_panel", kind, 1) is None
