"""The AMX bf16 matmul (csrc/amx.c) over row-major weights: x @ W.T for every row count, odd
output sizes, both output dtypes and any thread count; which shapes it takes; that the chooser
can pick it and then keeps the one row-major weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels, cpu_linear, kernel_choice
from minisgl.layers.kernel_choice import BUCKETS
from minisgl.testing import builds
from minisgl.testing.switch_clock import check_measured_once


def _amx_here() -> bool:
    return cpu_kernels.supports_amx(torch.bfloat16, torch.zeros(16, 32, dtype=torch.bfloat16))


needs_amx = pytest.mark.skipif(
    not _amx_here(), reason="this CPU (or its OS, or the kernels' build) has no AMX-BF16"
)


def _reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T in float64 (bf16 products are exact there) and the bound on an fp32 sum's error:
    K roundings of at most 2^-24 each of the partial sums, which are bounded by |x| @ |w|.T."""
    exact = F.linear(x.double(), w.double())
    bound = F.linear(x.double().abs(), w.double().abs()) * x.shape[1] * 2.0**-24
    return exact, bound


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 7, 8, 15, 16, 17, 33, 100, 300])
def test_matches_an_exact_product_for_every_row_count(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    for n, k in [(200, 96), (40, 64), (33, 1024)]:  # n not a multiple of 16 (nor of 32)
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        exact, bound = _reference(x, w)
        y32 = cpu_kernels.amx(x, w, torch.float32)
        assert y32.shape == (m, n) and y32.dtype == torch.float32
        assert ((y32.double() - exact).abs() <= bound + 1e-30).all()
        y16 = cpu_kernels.amx(x, w)  # x's dtype: bf16, the fp32 result rounded once
        assert y16.dtype == torch.bfloat16
        assert torch.equal(y16, y32.bfloat16())


@needs_amx
def test_prefill_sized_inputs_go_a_chunk_of_rows_at_a_time() -> None:
    """More rows than a pass keeps in L2 (at most 512 of K=1024 on any CPU) are multiplied in
    chunks, each with its own packed x: every chunk's rows land where they belong."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 1024, generator=g).bfloat16()
    x = torch.randn(1100, 1024, generator=g).bfloat16()
    exact, bound = _reference(x, w)
    y = cpu_kernels.amx(x, w, torch.float32)
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()


@needs_amx
def test_two_threads_compute_what_one_does() -> None:
    """Each block of weight rows is computed whole by one thread in one order, so the split
    (and which thread takes which block) never changes a result."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 256, generator=g).bfloat16()
    x = torch.randn(37, 256, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.amx(x, w, torch.float32)
        torch.set_num_threads(2)
        two = cpu_kernels.amx(x, w, torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_amx
@pytest.mark.parametrize("m", [1, 8, 17, 40])
def test_rows_left_to_the_hardware_prefetcher_give_the_same_bits(m: int) -> None:
    """Weight rows of 4 KB or more (K >= 2048) left to the hardware prefetcher, each k step's
    lines fetched a step ahead, instead of the next block prefetched: only where lines come
    from changes, so every result keeps its bits; shorter rows (K = 1024) take the block
    prefetch either way. A short last block, one x tile and two."""
    lib = cpu_kernels.load()
    assert lib is not None and lib.amx_rows_to_hardware is not None
    g = torch.Generator().manual_seed(m)
    before = lib.amx_rows_to_hardware.value
    try:
        for n, k in [(200, 2048), (33, 4096), (70, 1024)]:
            w = torch.randn(n, k, generator=g).bfloat16()
            x = torch.randn(m, k, generator=g).bfloat16()
            exact, bound = _reference(x, w)
            ys = []
            for on in (0, 1):
                lib.amx_rows_to_hardware.value = on
                ys.append(cpu_kernels.amx(x, w, torch.float32))
            assert ((ys[1].double() - exact).abs() <= bound + 1e-30).all()
            assert torch.equal(ys[0], ys[1])
    finally:
        lib.amx_rows_to_hardware.value = before


@needs_amx
@pytest.mark.parametrize("faster", [True, False])
def test_long_rows_go_to_the_hardware_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Measured once per process on the running machine (where the chooser first offers amx):
    on where 8 rows against cold long-row weights ran 3% faster that way, else off."""
    lib = cpu_kernels.load()
    assert lib is not None and lib.amx_rows_to_hardware is not None
    check_measured_once(
        monkeypatch, "amx", lib.amx_rows_to_hardware, "_AMX_ROWS_MEASURED", "_AMX_ROWS_SHAPE",
        faster, lambda names: "amx" in names,
    )  # fmt: skip


@needs_amx
@pytest.mark.parametrize("m", [33, 48, 64])
def test_three_and_four_x_tiles_give_each_row_its_own_bits(m: int) -> None:
    """33 to 64 rows of x (the block's halves in turn, each against every x tile, where it
    takes them; passes of two x tiles elsewhere): every row's result is the one it gets alone
    (one x tile), bit for bit, whatever the tiles beside it; a short last block too."""
    g = torch.Generator().manual_seed(m)
    for n, k in [(70, 1024), (40, 2048), (33, 4096)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        y = cpu_kernels.amx(x, w, torch.float32)
        exact, bound = _reference(x, w)
        assert ((y.double() - exact).abs() <= bound + 1e-30).all()
        for m0 in range(0, m, 16):
            alone = cpu_kernels.amx(x[m0 : m0 + 16], w, torch.float32)
            assert torch.equal(y[m0 : m0 + 16], alone)


@needs_amx
def test_takes_bf16_with_k_a_multiple_of_32_only() -> None:
    w = torch.zeros(64, 48, dtype=torch.bfloat16)
    assert not cpu_kernels.supports_amx(torch.bfloat16, w)  # K % 32 != 0
    assert cpu_kernels.supports_amx(torch.bfloat16, torch.zeros(64, 64, dtype=torch.bfloat16))
    assert not cpu_kernels.supports_amx(torch.float32, torch.zeros(64, 64, dtype=torch.bfloat16))
    assert not cpu_kernels.supports_amx(torch.float32, torch.zeros(64, 64))
    assert "amx" not in cpu_linear.available(w, torch.bfloat16)


@needs_amx
def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("MINISGL_CPU_AMX", "0")
    assert not cpu_kernels.supports_amx(torch.bfloat16, w)
    assert "amx" not in cpu_linear.available(w, torch.bfloat16)


@needs_amx
def test_the_chooser_can_pick_it_and_keeps_the_row_major_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert "amx" in cpu_linear.available(w, torch.bfloat16)
    assert kernel_choice.LAYOUT["amx"] == "row"
    # Measured fastest from 9 rows on (as the real timings have it on this kind of CPU).
    timings: dict[str, list[float | None]] = {
        name: [None] * len(BUCKETS) for name in cpu_linear.CANDIDATES
    }
    timings["gemv512"] = [1.0, 1.0, 1.0, 5.0, 20.0, 50.0, 100.0, 100.0]
    timings["amx"] = [2.0, 2.0, 2.0, 2.0, 4.0, 8.0, 30.0, 30.0]
    timings["torch"] = [9.0, 9.0, 9.0, 9.0, 9.0, 12.0, 60.0, 60.0]
    timings["panel"] = [1.0, 1.0, 1.0, 4.0, 15.0, 30.0, 40.0, 40.0]
    assert all(len(ts) == len(BUCKETS) for ts in timings.values())
    monkeypatch.delenv("MINISGL_CPU_LINEAR", raising=False)
    monkeypatch.setattr(cpu_linear, "measure", lambda *a, **k: timings)
    monkeypatch.setattr(cpu_linear, "tuning_cache", lambda: _NoCache())
    plan = cpu_linear.choose([w], torch.bfloat16, None, "full")
    picks = plan.single()
    assert picks is not None and picks[3:] == ("amx",) * (len(BUCKETS) - 3)
    kernel = cpu_linear.CpuLinearKernel.create(w, tuning="full")
    assert kernel is not None and kernel.picks == picks and kernel.packed == {}
    assert kernel.weight is not None and kernel.weight.data_ptr() == w.data_ptr()
    x = torch.randn(40, 64).bfloat16()
    torch.testing.assert_close(kernel(x), F.linear(x, w), rtol=1e-2, atol=1e-2)


@needs_amx
def test_untimed_defaults_run_amx_from_two_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that does not time (tuning "off", or timings other work disturbed) still gets
    the tiles, on the row-major weight alone."""
    monkeypatch.delenv("MINISGL_CPU_LINEAR", raising=False)
    w = torch.randn(48, 64).bfloat16()
    picks = cpu_linear.default_picks(cpu_linear.available(w, w.dtype), w.dtype)
    one = "gemv512" if cpu_kernels.supports_gemv512(w.dtype, w) else "gemv"
    assert picks == (one,) + ("amx",) * (len(BUCKETS) - 1)
    kernel = cpu_linear.CpuLinearKernel.create(w, tuning="off")
    assert kernel is not None and kernel.picks == picks and kernel.packed == {}


def test_forced_everywhere_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_CPU_LINEAR=amx: every row count on AMX where it runs, the defaults elsewhere."""
    monkeypatch.setenv("MINISGL_CPU_LINEAR", "amx")
    w = torch.randn(48, 64).bfloat16()
    kernel = cpu_linear.CpuLinearKernel.create(w)
    assert kernel is not None
    if _amx_here():
        assert kernel.picks == ("amx",) * len(BUCKETS)
    else:
        assert "amx" not in kernel.picks


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_builds_without_amx_say_so(tmp_path: Path, isa: str) -> None:
    """The AVX2 build and an AVX-512 build without AMX compile the AMX source too and report
    no AMX (never a crash)."""
    lib = builds.without_amx("amx.c", isa, tmp_path)
    if lib is None:
        pytest.skip("no C compiler here")
    assert lib.amx_available() == 0


class _NoCache:
    def get(self, *args: object) -> None:
        return None

    def put(self, *args: object) -> None:
        return None
