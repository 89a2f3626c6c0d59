"""benchmarks/roofline.py's read bandwidth: the best of the read loops (stream.c), never below
the plain loop, with the spread of its passes; every loop reads every value."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from minisgl.layers import cpu_kernels


def test_the_read_rate_is_the_best_loop_and_never_below_the_plain_one(
    import_benchmark: Callable[[str], ModuleType],
) -> None:
    roofline = import_benchmark("roofline")
    rate = roofline.read_rates(nbytes=16 << 20, passes=3)
    assert "plain" in rate.passes and set(rate.passes) <= set(roofline.READ_LOOPS)
    assert all(len(v) == 3 for v in rate.passes.values())
    # The figure is the fastest pass any loop made, the plain loop's included.
    assert rate.best == max(max(v) for v in rate.passes.values())
    assert rate.best >= rate.plain == max(rate.passes["plain"])
    assert rate.median <= rate.best
    assert roofline.read_bandwidth.__doc__  # the public entry qgemv_bench uses
    line = rate.describe()
    assert rate.loop in line and "median" in line and "plain loop best" in line


def test_the_machine_line_shows_the_read_loop_and_its_spread(
    import_benchmark: Callable[[str], ModuleType],
) -> None:
    roofline = import_benchmark("roofline")
    passes = {"plain": [40e9, 44e9], "prefetch 2 KB to L1": [50e9, 46e9]}
    read = roofline.ReadRate(50e9, "prefetch 2 KB to L1", 48e9, 44e9, passes)
    machine = roofline.Machine("AMD EPYC", "avx512f", 2, read.best, {}, {}, None, read)
    assert (
        "read 50.0 GB/s (prefetch 2 KB to L1; median of its 2 passes 48.0, plain loop best "
        "44.0)" in machine.describe()
    )


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels on this CPU")
@pytest.mark.parametrize("n", [5, 64, 64 * 1000, 64 * 1000 + 37])
def test_every_read_loop_reads_every_value(
    import_benchmark: Callable[[str], ModuleType], n: int
) -> None:
    roofline = import_benchmark("roofline")
    lib = roofline._stream_lib()
    buf = (torch.arange(n) % 7).float()  # small integers: every order of the adds is exact
    for loop in roofline.READ_LOOPS.values():
        assert lib.stream_read_ahead(buf.data_ptr(), n, *loop) == float(buf.sum())
    assert cpu_kernels.load().stream_read(buf.data_ptr(), n) == float(buf.sum())


def test_decode_step_times_the_read_loop_between_the_steps(
    import_benchmark: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--timings: the pure read loop over the weights' bytes, timed as the steps are, with its
    spread (a machine whose memory itself is noisy shows it there as much as in the steps)."""
    roofline = import_benchmark("roofline")
    decode_step = import_benchmark("decode_step")
    read = roofline.read_rates(nbytes=8 << 20, passes=1)
    machine = roofline.Machine("AMD EPYC", "avx512f", 1, read.best, {}, {}, None, read)
    reader = decode_step.ReadLoop(8 << 20, machine)
    for _ in range(3):
        reader.run(roofline.time.perf_counter)
    report = reader.report()
    assert report.startswith(f"read loop ({read.loop}) over 0.01 GB, between the steps: best ")
    assert "median/best" in report and "page faults" in report
    # Each step against the pass of its own repeat: steps twice their passes read 2.00 throughout.
    ratio = reader.against([2 * t for t in reader.times])
    assert ratio.strip() == (
        "step / the read pass of its repeat (per weight byte): p10 2.00  p50 2.00  p90 2.00"
    )
    # Weights larger than READ_MAX: the pass reads READ_MAX bytes, the ratio is per byte.
    monkeypatch.setattr(decode_step.ReadLoop, "READ_MAX", 4 << 20)
    big = decode_step.ReadLoop(16 << 20, machine)
    assert big.buf.numel() * 4 == 4 << 20
    big.run(roofline.time.perf_counter)
    assert "p50 1.00" in big.against([4 * big.times[0]])


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no huge-page advice here")
def test_qgemv_bench_puts_the_quantized_weights_on_huge_pages(
    import_benchmark: Callable[[str], ModuleType],
) -> None:
    """qgemv_bench compares the quantized kernels with the bf16 ones on huge pages, as a loaded
    model holds both (the bf16 weights there always were; the quantized ones sat on 4 KB
    pages, a TLB miss per 4 KB that the bf16 stream did not pay): each tensor of the weight
    moved onto its own mapping, the same values."""
    bench = import_benchmark("qgemv_bench")
    w = bench.random_weight("int4", 4096, 2048, torch.Generator().manual_seed(0))
    before = {name: getattr(w, name).clone() for name in ("codes", "scales", "zeros")}
    ptrs = {name: getattr(w, name).data_ptr() for name in before}
    assert bench.onto_huge_pages(w) is w
    for name, old in before.items():
        t = getattr(w, name)
        if old.numel() * old.element_size() >= 2 << 20:  # hugepages moves from 2 MB up
            assert t.data_ptr() != ptrs[name], name
        assert torch.equal(t, old), name
