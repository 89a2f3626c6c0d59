"""The CPU matmul chooser driven by injected timings: a layer runs the candidate that was
fastest for its row count among those on the one layout of its weight it keeps, the timings are
cached per machine and reused, a second weight copy exists only where the user allowed memory
for it and a pick needs it, and every candidate computes the same product."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels, cpu_linear, kernel_choice
from minisgl.layers.kernel_choice import BUCKETS, LAYOUT, TIMED_ROWS
from minisgl.testing.flushes import Passes


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINISGL_CPU_LINEAR", raising=False)
    monkeypatch.setattr(cpu_linear, "_MEMO", {})


def weight(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).to(dtype)


class Timings:
    """A stand-in for `measure`: `winners[b]` is fastest in bucket b; counts its calls."""

    def __init__(self, winners: Sequence[str], spread: float = 1.0) -> None:
        self.winners = list(winners)
        self.calls = 0
        self.spread = spread  # slowest pass over fastest, as a busy machine shows

    def __call__(
        self, weights, x_dtype, out_dtype, avail, spreads=None
    ) -> dict[str, list[float | None]]:
        self.calls += 1
        if spreads is not None:
            spreads += [self.spread] * 10
        return {
            name: [
                (0.1 if self.winners[b] == name else 1.0) if name in avail else None
                for b in range(len(BUCKETS))
            ]
            for name in cpu_linear.CANDIDATES
        }


def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record (candidate, rows) of every matmul run."""
    calls: list[tuple[str, int]] = []
    for name, run in list(cpu_linear._RUN.items()):

        def wrapped(x, w, p, o, run=run, name=name):  # noqa: ANN001, ANN202
            calls.append((name, x.shape[0]))
            return run(x, w, p, o)

        monkeypatch.setitem(cpu_linear._RUN, name, wrapped)
    return calls


class Layer:
    def __init__(self, w: torch.Tensor, out: torch.dtype | None = None) -> None:
        self.weight, self.kernel_out_dtype, self.kernel = w, out, None


def winners_from(avail: Sequence[str]) -> list[str]:
    """A different candidate per bucket, cycling through what this machine can run on the
    row-major weight."""
    row = [a for a in avail if LAYOUT[a] == "row"]
    return [row[(b + 1) % len(row)] for b in range(len(BUCKETS))]


def test_each_row_count_runs_the_fastest_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    avail = cpu_linear.available(w, w.dtype)
    timings = Timings(winners_from(avail))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    calls = spy(monkeypatch)
    kernel = cpu_linear.CpuLinearKernel.create(w)
    assert kernel is not None and kernel.picks == tuple(timings.winners)
    rows_per_bucket = [1, 3, 6, 12, 24, 40, 100]
    for rows in rows_per_bucket:
        x = torch.randn(rows, 64).bfloat16()
        got = kernel(x)
        torch.testing.assert_close(
            got.double(), F.linear(x.double(), w.double()), rtol=2e-2, atol=0.1
        )
    assert calls == [(timings.winners[b], r) for b, r in enumerate(rows_per_bucket)]


def test_timings_are_cached_on_disk_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    avail = cpu_linear.available(w, w.dtype)
    timings = Timings(winners_from(avail))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    first = cpu_linear.CpuLinearKernel.create(w, tuning="cached")
    assert timings.calls == 1
    monkeypatch.setattr(cpu_linear, "_MEMO", {})  # a restart: only the file remains
    again = cpu_linear.CpuLinearKernel.create(w, tuning="cached")
    assert timings.calls == 1 and again is not None and first is not None
    assert again.picks == first.picks
    # "full" measures again and rewrites the file.
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    timings.winners = [avail[0]] * len(BUCKETS)
    full = cpu_linear.CpuLinearKernel.create(w, tuning="full")
    assert timings.calls == 2 and full is not None and full.picks == (avail[0],) * len(BUCKETS)
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    assert cpu_linear.CpuLinearKernel.create(w).picks == full.picks  # type: ignore[union-attr]
    # Another shape is measured on its own.
    cpu_linear.CpuLinearKernel.create(torch.randn(32, 64).bfloat16())
    assert timings.calls == 3


def test_a_different_thread_count_tunes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    timings = Timings(winners_from(cpu_linear.available(w, w.dtype)))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    cpu_linear.CpuLinearKernel.create(w)
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cpu_linear.CpuLinearKernel.create(w)
    finally:
        torch.set_num_threads(threads)
    assert timings.calls == 2


def test_a_process_that_changes_its_thread_count_tunes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within one process (torch.set_num_threads, as a benchmark's --threads): picks timed on
    one thread count are not reused on another, and each count's are reused on it. Before,
    the in-memory picks were keyed without the count."""
    w = weight()
    timings = Timings(winners_from(cpu_linear.available(w, w.dtype)))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    threads = torch.get_num_threads()
    try:
        for n in (threads, threads + 1, threads, threads + 1):
            torch.set_num_threads(n)
            cpu_linear.CpuLinearKernel.create(w)
    finally:
        torch.set_num_threads(threads)
    assert timings.calls == 2


def test_off_never_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    timings = Timings(["torch"] * len(BUCKETS))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    kernel = cpu_linear.CpuLinearKernel.create(w, tuning="off")
    assert timings.calls == 0
    assert kernel is not None and kernel.picks == row_defaults(w)


def row_defaults(w: torch.Tensor) -> tuple[str, ...]:
    """The untimed picks a layer runs by default (one layout, no copy): on AVX-512 without
    AMX, panel512.c's panels for every row count (a bf16 weight); elsewhere the defaults among
    the candidates on the weight as loaded (where the CPU multiplies bf16 natively without
    AMX, the defaults would name oneDNN, whose copy is not allowed by default)."""
    avail = cpu_linear.available(w, w.dtype)
    if "panel" in avail and "amx" not in avail and cpu_kernels.panel_pairs():
        return ("panel",) * len(BUCKETS)
    return cpu_linear.default_picks([a for a in avail if LAYOUT[a] == "row"], w.dtype)


@pytest.mark.parametrize("pairs", [True, False])
def test_untimed_defaults_on_pairs_panels_keep_one_copy(
    monkeypatch: pytest.MonkeyPatch, pairs: bool
) -> None:
    """Tuning "off" where the panels are panel512.c's (AVX-512, no AMX): every row count of
    a bf16 weight on the panels, which are then the only copy of it (the layer's weight on the
    meta device), and a tied embedding can read its rows from them; with panel.c's panels (no
    AVX-512) the defaults stay on the weight as loaded. fp32 weights never go on panels."""
    w = weight()
    if "panel" not in cpu_linear.available(w, w.dtype):
        pytest.skip("no CPU kernels here")
    monkeypatch.setattr(cpu_kernels, "panel_pairs", lambda: pairs)
    monkeypatch.setattr(cpu_linear, "measure", Timings(["torch"] * len(BUCKETS)))
    avail = [a for a in cpu_linear.available(w, w.dtype) if a != "amx"]
    defaults = cpu_linear.default_picks(avail, w.dtype)
    assert (defaults == ("panel",) * len(BUCKETS)) is pairs
    assert "panel" not in cpu_linear.default_picks(avail, torch.float32)
    if "amx" in cpu_linear.available(w, w.dtype):
        return  # AMX's defaults lead there
    layer, head = Layer(w), Layer(weight())
    cpu_linear.prepack_modules([layer, head], "off", lookup={id(head.weight)})
    x = torch.randn(5, 64).bfloat16()
    for m, original in ((layer, w), (head, weight())):
        kernel = m.kernel
        assert kernel is not None and (kernel.picks == ("panel",) * len(BUCKETS)) is pairs
        if pairs:  # one layout: the panels alone
            assert set(kernel.packed) == {"panel"} and kernel.weight is None
            assert m.weight.device.type == "meta" and m.weight.shape == original.shape
            got = cpu_kernels.panel_rows(kernel.packed["panel"], torch.tensor([0, 17, 47]))
            assert torch.equal(got, original[[0, 17, 47]])
        else:
            assert not kernel.packed and m.weight.device.type == "cpu"
        torch.testing.assert_close(
            kernel(x).double(), F.linear(x.double(), original.double()), rtol=1e-2, atol=1e-2
        )


def test_pairs_panels_exactly_on_the_avx512_build() -> None:
    """panel512.c's layout is the panels' exactly on the AVX-512 build, with AVX512-BF16 or
    without (MINISGL_CPU_ISA=avx2 or an AVX2 CPU: panel.c's)."""
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    wide = cpu_kernels.isa() == "avx512"
    assert cpu_kernels.panel_pairs() is wide
    assert cpu_kernels.panel_pack(weight()).pairs is wide


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_kernel_tuning"):
        cpu_linear.CpuLinearKernel.create(weight(), tuning="sometimes")


def test_onednn_copy_only_where_a_pick_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    if "onednn" not in cpu_linear.available(w, w.dtype):
        # This CPU's oneDNN refuses bf16: stand in for it, the bookkeeping is what is tested.
        monkeypatch.setattr(cpu_linear, "_onednn_pack", lambda w: w.clone())
        monkeypatch.setitem(cpu_linear._RUN, "onednn", lambda x, w, p, o: F.linear(x, p))
    avail = cpu_linear.available(w, w.dtype)
    ours = [n for n in avail if n != "onednn"]
    monkeypatch.setattr(cpu_linear, "measure", Timings([ours[0]] * len(BUCKETS)))
    kernel = cpu_linear.CpuLinearKernel.create(w)
    assert kernel is not None and not kernel.packed
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    monkeypatch.setattr(cpu_linear, "measure", Timings([ours[0]] * (len(BUCKETS) - 1) + ["onednn"]))
    layer = Layer(w)
    cpu_linear.prepack_modules([layer], "full", copies_max_bytes=1 << 30)
    kernel = layer.kernel
    assert kernel is not None and set(kernel.packed) == {"onednn"}
    x = torch.randn(100, 64).bfloat16()
    torch.testing.assert_close(kernel(x).float(), F.linear(x, w).float(), rtol=2e-2, atol=0.1)
    # MINISGL_CPU_ONEDNN_GEMM=0: never a second copy, whatever the timings say.
    monkeypatch.setenv("MINISGL_CPU_ONEDNN_GEMM", "0")
    assert "onednn" not in cpu_linear.available(w, w.dtype)


def test_panel_copy_only_where_a_pick_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight()
    avail = cpu_linear.available(w, w.dtype)
    if "panel" not in avail:  # no kernels here
        return
    assert "panel" not in cpu_linear.available(w, w.dtype, copies=False)
    assert "panel" not in cpu_linear.available(weight(torch.float32), torch.float32)
    monkeypatch.setattr(cpu_linear, "measure", Timings(["panel"] * 5 + ["gemm"] * 3))
    # One layout by default: the panels, which won more of the row counts, serve them all.
    kernel = cpu_linear.CpuLinearKernel.create(w)
    assert (
        kernel is not None and kernel.picks == ("panel",) * len(BUCKETS) and kernel.weight is None
    )
    layer = Layer(w)
    cpu_linear.prepack_modules([layer], copies_max_bytes=1 << 30)
    kernel = layer.kernel
    assert kernel is not None and set(kernel.packed) == {"panel"} and kernel.weight is not None
    calls = spy(monkeypatch)
    layer = Layer(w)
    cpu_linear.prepack_modules([layer], copies_max_bytes=1 << 30)  # on the spied runs
    kernel = layer.kernel
    assert kernel is not None
    for rows in (1, 8, 16, 100):
        x = torch.randn(rows, 64).bfloat16()
        want = F.linear(x.double(), w.double())
        torch.testing.assert_close(kernel(x).double(), want, rtol=2e-2, atol=0.1)
    assert [name for name, _ in calls] == ["panel", "panel", "panel", "gemm"]


def test_a_weight_no_pick_reads_is_dropped_unless_shared(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """All panel: the panels are the only copy (the weight keeps its shape and dtype on the meta
    device), except where another module reads the weight too; mixed picks keep both, and the
    one-line summary says how much the second copies take."""
    if "panel" not in cpu_linear.available(weight(), torch.bfloat16):
        return
    alone, tied = Layer(weight()), Layer(weight() + 1)
    monkeypatch.setattr(cpu_linear, "measure", Timings(["panel"] * len(BUCKETS)))
    want = F.linear(torch.ones(3, 64).double(), alone.weight.double())
    cpu_linear.prepack_modules([alone, tied], "cached", shared={id(tied.weight)})
    assert alone.weight.device.type == "meta" and alone.weight.shape == (48, 64)
    assert alone.weight.dtype == torch.bfloat16
    assert tied.weight.device.type == "cpu"
    got = alone.kernel(torch.ones(3, 64).bfloat16())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.1)

    mixed = Layer(torch.randn(32, 64).bfloat16())
    monkeypatch.setattr(cpu_linear, "measure", Timings(["gemv"] + ["panel"] * (len(BUCKETS) - 1)))
    big = Layer(torch.randn(4096, 256).bfloat16())  # 2 MiB: the log line says so
    with caplog.at_level(logging.INFO, logger="minisgl.layers.cpu_linear"):
        cpu_linear.prepack_modules([mixed, big], "cached", copies_max_bytes=1 << 30)
    assert mixed.weight.device.type == "cpu" and mixed.kernel.weight is not None
    assert "second weight copies: 2 MiB" in caplog.text


def test_all_plain_linear_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "measure", Timings(["torch"] * len(BUCKETS)))
    assert cpu_linear.CpuLinearKernel.create(weight()) is None


@pytest.mark.parametrize("name", cpu_linear.CANDIDATES)
def test_forcing_a_candidate(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    w = weight()
    monkeypatch.setenv("MINISGL_CPU_LINEAR", name)
    monkeypatch.setattr(cpu_linear, "measure", Timings(["torch"] * len(BUCKETS)))
    kernel = cpu_linear.CpuLinearKernel.create(w)
    avail = cpu_linear.available(w, w.dtype)
    if name not in avail:  # not on this CPU: the defaults, never a failure
        assert kernel is not None and kernel.picks == row_defaults(w)
        return
    if name == "torch":
        assert kernel is None  # plain F.linear is what the layer does anyway
        return
    assert kernel is not None and kernel.picks == (name,) * len(BUCKETS)


def test_each_timed_pass_reads_its_weights_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed pass is preceded by a flush of what it reads (the weights, and a candidate's
    own copy of them: the panels) out of the caches, whatever the size of the timing set: a set
    of 48 MB of distinct weights ran from a Xeon VM's 480 MB L3 at ~1.9x a step's rate, and the
    chooser ranked the kernels by their arithmetic. Without the kernels, a set smaller than
    _COLD_BYTES is preceded by a read of other memory instead."""
    w = [weight(torch.bfloat16) for _ in range(3)]
    avail = [n for n in ("gemm", "panel") if n in cpu_linear.available(w[0], torch.bfloat16)]
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    passes = Passes(monkeypatch)
    cpu_linear.measure(w, torch.bfloat16, None, avail, clock=passes.clock)
    assert passes.each_flushed()
    weights = {t.data_ptr() for t in w}
    assert all(weights <= ptrs for ptrs in passes.flushed())  # and the panels' copies:
    if "panel" in avail:
        assert any(len(ptrs) > len(w) for ptrs in passes.flushed())
    # without the kernels: a read of other memory before a small set's passes, none for a big one
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    big = torch.zeros(cpu_linear._COLD_BYTES // 4 // 64, 64)
    assert cpu_linear._cooler([big]) is None and cpu_linear._cooler([big[:16]]) is not None


def test_a_copy_without_an_address_is_pushed_out_by_reading_other_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN's reordered weight is an opaque tensor (no address to flush): a pass that reads
    one is preceded by a read of other memory a quarter larger than the last-level cache, the
    strided tensors beside it still flushed. Before, the flush was given the opaque tensor,
    which it skipped: oneDNN's copy was timed from a large L3 (a Xeon VM's 480 MB) and picked
    for decode batches where it ran 0.6x our AMX kernel's speed."""
    w = weight(torch.float32)
    opaque = w.to_mkldnn()
    monkeypatch.setattr(cpu_linear, "_last_level_cache", lambda: 64 << 20, raising=False)
    lib = cpu_kernels.load()
    reads: list[int] = []
    if lib is not None:
        passes = Passes(monkeypatch)
        read = lib.stream_read
        monkeypatch.setattr(lib, "stream_read", lambda p, n: reads.append(n * 4) or read(p, n))
        cool = cpu_linear._cooler([w, opaque])
        assert cool is not None
        cool()
        assert passes.flushed() == [{w.data_ptr()}] and reads == [80 << 20]
        cpu_linear._cooler([w])()  # all strided: a flush, no read
        assert len(passes.flushed()) == 2 and len(reads) == 1
    else:  # without the kernels: a sum over the other memory
        sums: list[int] = []
        total = torch.Tensor.sum
        monkeypatch.setattr(torch.Tensor, "sum", lambda t: sums.append(t.numel() * 4) or total(t))
        cool = cpu_linear._cooler([w, opaque])
        assert cool is not None
        cool()
        assert sums == [80 << 20]
    cpu_linear._OTHER.clear()


def test_the_other_memory_is_freed_after_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chooser's read of other memory (up to a last-level cache and a quarter) is not kept
    once the timings are taken: it would add to the scheduler's resident memory."""
    monkeypatch.setattr(cpu_linear, "_last_level_cache", lambda: 64 << 20, raising=False)
    w = [weight(torch.float32) for _ in range(2)]
    avail = cpu_linear.available(w[0], torch.float32)
    opaque = w[0].to_mkldnn()
    seen: list[int] = []
    real = cpu_linear._cooler

    def cooler(tensors):  # noqa: ANN001, ANN202
        fn = real(list(tensors) + [opaque])
        seen.append(len(cpu_linear._OTHER))
        return fn

    monkeypatch.setattr(cpu_linear, "_cooler", cooler)
    cpu_linear.measure(w, torch.float32, None, avail)
    assert seen and all(n == 1 for n in seen)  # one buffer, shared by the candidates
    assert not cpu_linear._OTHER


def test_a_flush_keeps_the_values() -> None:
    """cpu_kernels.flush drops cache lines, never their data (odd sizes and offsets too)."""
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    t = torch.randn(1000, 37)
    before = t.clone()
    assert cpu_kernels.flush([t, t[3:], t[5, 1:4], torch.empty(0)])
    assert torch.equal(t, before)


def _scripted_passes(
    monkeypatch: pytest.MonkeyPatch, costs: dict[str, tuple[float, float]], disturbed: int = 1
) -> Callable[[], float]:
    """The candidates' runs replaced: name -> (seconds a pass, seconds of each of its first
    `disturbed` timed passes) on a fake clock, which is returned for measure."""
    now = [0.0]
    seen: dict[tuple[str, int], int] = {}

    def fake(name: str, cost: float, first: float):  # noqa: ANN202
        def run(x, w, p, o):  # noqa: ANN001, ANN202
            calls = seen[(name, x.shape[0])] = seen.get((name, x.shape[0]), 0) + 1
            now[0] += first if 2 <= calls <= 1 + disturbed else cost  # call 1: the warm-up
            return torch.empty(x.shape[0], w.shape[0])

        return run

    for name, (cost, first) in costs.items():
        monkeypatch.setitem(cpu_linear._RUN, name, fake(name, cost, first))
    return lambda: now[0]


def test_one_slow_first_pass_never_drops_the_self_contained_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of other work over the panels' first pass (5x slower) does not drop them as
    hopeless: they are a layout's only candidate, so one disturbed pass would decide the layout
    of the weight, and with it the kernel, for every row count. Their later passes count, as
    anyone's do."""
    w = weight()
    if "panel" not in cpu_linear.available(w, w.dtype):
        pytest.skip("no CPU kernels here")
    clock = _scripted_passes(monkeypatch, {"gemv": (1.0, 1.0), "panel": (0.5, 5.0)})
    timings = cpu_linear.measure([w], w.dtype, None, ["gemv", "panel"], clock=clock)
    assert timings["panel"] == [0.5] * len(BUCKETS) and timings["gemv"] == [1.0] * len(BUCKETS)
    assert kernel_choice.single_layout(timings) == ("panel",) * len(BUCKETS)


def test_one_disturbed_pass_does_not_drop_the_fastest_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of other work over a kernel's first timing pass (10x its time, 5x the leader's)
    does not cost it the bucket: it is dropped only when still far behind after
    kernel_choice.DROP_AFTER passes, so its undisturbed second pass counts and it is picked."""
    w = weight()
    if "gemv" not in cpu_linear.available(w, w.dtype):
        pytest.skip("no CPU kernels here")
    clock = _scripted_passes(monkeypatch, {"gemv": (0.5, 5.0), "torch": (1.0, 1.0)})
    timings = cpu_linear.measure([w], w.dtype, None, ["gemv", "torch"], clock=clock)
    assert timings["gemv"] == [0.5] * len(BUCKETS) and timings["torch"] == [1.0] * len(BUCKETS)
    assert kernel_choice.pick(timings) == ("gemv",) * len(BUCKETS)


def test_a_near_tie_is_timed_again_before_it_is_decided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Other work over every one of a kernel's first passes (1.1x the other's time where it is
    truly 0.9x) leaves it within kernel_choice.CONFIRM_WITHIN of the leader: both take more
    passes in turn, and the faster is picked. Before, the passes' bests decided at once and
    the slower kernel kept every bucket."""
    w = weight()
    if "gemv" not in cpu_linear.available(w, w.dtype):
        pytest.skip("no CPU kernels here")
    costs = {"gemv": (0.9, 1.1), "torch": (1.0, 1.0)}
    clock = _scripted_passes(monkeypatch, costs, disturbed=cpu_linear._MIN_REPEATS)
    timings = cpu_linear.measure([w], w.dtype, None, ["gemv", "torch"], clock=clock)
    assert timings["gemv"] == pytest.approx([0.9] * len(BUCKETS))
    assert kernel_choice.pick(timings) == ("gemv",) * len(BUCKETS)


def test_a_timing_slice_keeps_columns_for_every_thread() -> None:
    """Where one weight is too big for a pass, the slice timed still gives each thread several
    16-column panels (as the whole weight does), not a few panels shared by many threads."""
    w = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in (2, 4):
            torch.set_num_threads(t)
            (part,) = cpu_linear._timing_set([w], 1024)
            assert part.shape[0] >= 8 * 16 * t and part.shape[1] == 1024
            assert part.data_ptr() == w.data_ptr()  # a view: no copy
    finally:
        torch.set_num_threads(threads)


def test_real_measurement_times_every_available_candidate_per_bucket() -> None:
    w = [weight(torch.float32), weight(torch.float32) + 1]
    avail = cpu_linear.available(w[0], torch.float32)
    timings = cpu_linear.measure(w, torch.float32, None, avail)
    assert set(timings) == set(cpu_linear.CANDIDATES)
    for name, times in timings.items():
        assert len(times) == len(TIMED_ROWS)
        if name not in avail:
            assert times == [None] * len(TIMED_ROWS)
        else:  # measured at least once
            assert all(t is not None and t > 0 for t in times)


def test_prepack_logs_one_line_per_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    layers = [
        Layer(weight(), None),
        Layer(weight() * 2, None),
        Layer(torch.randn(16, 64).bfloat16(), torch.float32),
    ]
    timings = Timings(["gemm"] * len(BUCKETS))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    with caplog.at_level(logging.INFO, logger="minisgl.layers.cpu_linear"):
        cpu_linear.prepack_modules(layers, "cached")
    assert timings.calls == 2  # one per distinct shape
    assert all(layer.kernel is not None for layer in layers)
    lines = [r.getMessage() for r in caplog.records if "CPU matmul kernels" in r.getMessage()]
    assert len(lines) == 1 and "48x64 bfloat16 [1+:gemm]" in lines[0]


@pytest.mark.parametrize("name", cpu_linear.CANDIDATES)
def test_an_input_in_another_dtype_still_multiplies(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Picks are made for x in the weight's dtype; a caller with fp32 x on bf16 weights (e.g.
    a layer that keeps activations in fp32) still gets x @ W.T."""
    w = weight()
    if name not in cpu_linear.available(w, w.dtype):
        assert name in (
            "gemv",
            "gemv512",
            "amx",
            "gemm",
            "panel",
            "onednn",
        )  # only torch is always there
        return
    monkeypatch.setenv("MINISGL_CPU_LINEAR", name)
    kernel = cpu_linear.CpuLinearKernel.create(w, out_dtype=torch.float32)
    x = torch.randn(5, 64)
    got = kernel(x) if kernel is not None else F.linear(x, w.float())
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.1)


def test_timings_from_a_busy_machine_give_the_defaults_and_are_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = weight()
    avail = cpu_linear.available(w, w.dtype)
    timings = Timings(winners_from(avail), spread=3.0)
    monkeypatch.setattr(cpu_linear, "measure", timings)
    kernel = cpu_linear.CpuLinearKernel.create(w)
    assert kernel is not None and kernel.picks == row_defaults(w)
    monkeypatch.setattr(cpu_linear, "_MEMO", {})  # a restart measures again
    cpu_linear.CpuLinearKernel.create(w)
    assert timings.calls == 2


def test_experts_run_the_measured_copy_free_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixture's experts go through the chooser too, but never through a candidate that keeps
    a second copy of the weights (oneDNN's layout): that would double the experts' memory."""
    from minisgl.layers.moe import FusedMoE, fused_moe

    moe = FusedMoE(num_experts=4, hidden_size=64, intermediate_size=32)
    g = torch.Generator().manual_seed(1)
    moe.w13.data = torch.randn(4, 64, 64, generator=g)
    moe.w2.data = torch.randn(4, 64, 32, generator=g)
    seen: list[Sequence[str]] = []

    def timings(weights, x_dtype, out_dtype, avail, spreads=None):  # noqa: ANN001, ANN202
        seen.append(list(avail))
        return Timings(["torch"] + [avail[0]] * (len(BUCKETS) - 1))(
            weights, x_dtype, out_dtype, avail, spreads
        )

    monkeypatch.setattr(cpu_linear, "measure", timings)
    calls = spy(monkeypatch)
    lines = moe.prepare_cpu_kernels()
    assert seen and all("onednn" not in a for a in seen)
    assert len(lines) == 2 and all("64x" in line for line in lines)
    x = torch.randn(6, 64, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [0, 3], [2, 1], [3, 0], [0, 2]])
    weights = torch.full((6, 2), 0.5)
    want = fused_moe(x, moe.w13, moe.w2, weights, ids)  # the untuned policy
    torch.testing.assert_close(moe(x, weights, ids), want, rtol=1e-5, atol=1e-4)
    # Experts 1 and 2 got 3 rows each (bucket 2-4): they ran the measured pick.
    assert (seen[0][0], 3) in calls
    assert moe.prepare_cpu_kernels("off") == []


def layouts_held(layer: Layer) -> int:
    """How many copies of its weight a layer keeps: the row-major one (unless on the meta
    device) and each packed layout."""
    kernel = layer.kernel
    packed = len(kernel.packed) if kernel is not None else 0
    return int(layer.weight.device.type != "meta") + packed


def test_no_second_copy_is_kept_unless_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Timings where the panels win prefill and the GEMV decode: by default each weight is
    kept once (and the log says what a copy would buy); with memory allowed for copies, both
    layouts, most gain per byte first, only as far as the allowance goes."""
    if "panel" not in cpu_linear.available(weight(), torch.bfloat16):
        return
    mixed = ["gemv"] * 4 + ["panel"] * 4

    def model() -> list[Layer]:
        return [Layer(weight()), Layer(weight() * 2), Layer(torch.randn(32, 64).bfloat16())]

    monkeypatch.setattr(cpu_linear, "measure", Timings(mixed))
    layers = model()
    w0 = layers[0].weight
    with caplog.at_level(logging.INFO, logger="minisgl.layers.cpu_linear"):
        cpu_linear.prepack_modules(layers)
    assert [layouts_held(m) for m in layers] == [1, 1, 1]
    line = next(r.getMessage() for r in caplog.records if "CPU matmul kernels" in r.getMessage())
    assert "second weight copies" not in line
    assert "--cpu-weight-copies-max-gb 0): copies not kept: 48x64" in line
    assert "rows 17-32 10.00x, 33-64 10.00x, 65-512 10.00x, >512 10.00x faster" in line
    for rows in (1, 100):  # one layout still serves every row count
        x = torch.randn(rows, 64).bfloat16()
        want = F.linear(x.double(), w0.double())
        torch.testing.assert_close(layers[0].kernel(x).double(), want, rtol=2e-2, atol=0.1)

    # Room for the 32x64 group's copy (4 KiB) but not the 48x64 pair's (12 KiB): the small
    # one gains as much per layer for fewer bytes.
    layers = model()
    cpu_linear.prepack_modules(layers, copies_max_bytes=8 << 10)
    assert [layouts_held(m) for m in layers] == [1, 1, 2]
    layers = model()
    cpu_linear.prepack_modules(layers, copies_max_bytes=1 << 30)
    assert [layouts_held(m) for m in layers] == [2, 2, 2]


def test_a_weight_kept_row_major_gets_row_picks_even_where_those_were_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timing drops a candidate far behind after one pass: where every row-major candidate was
    dropped in some bucket (panels 3x ahead), a weight read elsewhere too (kept row-major)
    still gets runnable picks, not a failed start."""
    if "panel" not in cpu_linear.available(weight(), torch.bfloat16):
        return

    def measure(weights, x_dtype, out_dtype, avail, spreads=None):  # noqa: ANN001, ANN202
        return {
            n: ([0.1] * 8 if n == "panel" else [1.0] * 7 + [None]) if n in avail else [None] * 8
            for n in cpu_linear.CANDIDATES
        }

    monkeypatch.setattr(cpu_linear, "measure", measure)
    shared = Layer(weight())
    cpu_linear.prepack_modules([shared], shared={id(shared.weight)})
    assert shared.kernel is not None and not shared.kernel.packed
    x = torch.randn(100, 64).bfloat16()
    want = F.linear(x.double(), shared.weight.double())
    torch.testing.assert_close(shared.kernel(x).double(), want, rtol=2e-2, atol=0.1)


class _OtherWork:
    """kernel_choice.OtherWork with a fixed share of the CPUs held by other processes."""

    held = 0.0

    def share(self) -> float:
        return self.held


def test_timings_beside_a_steady_load_are_used_but_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every pass slowed alike (no spread), but other processes were busy: the measured picks
    serve this start, and the next start measures again (and caches, once it is quiet)."""
    w = weight()
    timings = Timings(winners_from(cpu_linear.available(w, w.dtype)))
    monkeypatch.setattr(cpu_linear, "measure", timings)
    monkeypatch.setattr(cpu_linear.kernel_choice, "OtherWork", _OtherWork)
    monkeypatch.setattr(_OtherWork, "held", 0.5)
    busy = cpu_linear.CpuLinearKernel.create(w)
    monkeypatch.setattr(cpu_linear, "_MEMO", {})  # a restart, now quiet: measures again
    monkeypatch.setattr(_OtherWork, "held", 0.0)
    quiet = cpu_linear.CpuLinearKernel.create(w)
    assert timings.calls == 2 and busy is not None and quiet is not None
    assert busy.picks == quiet.picks
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    cpu_linear.CpuLinearKernel.create(w)
    assert timings.calls == 2  # cached


def test_native_bf16_follows_onednn_isa_cap() -> None:
    """oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA) has no native bf16 matmul, whatever CPUID says:
    the untimed defaults and MoE's fallback must not count on one (it was true on an AMX Xeon)."""
    code = "from minisgl.layers import cpu_linear; print(cpu_linear.native_bf16())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"
