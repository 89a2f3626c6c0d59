"""offline_throughput.py's single-stream figure: decode tokens/s with the prompt's prefill
cancelled out by two generation lengths, robust to a run that other work held up."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import pytest

PREFILL_S, TOKEN_S = 0.05, 0.01


class FakeClock:
    """time.perf_counter for the script: a generation of n tokens takes PREFILL_S + n * TOKEN_S,
    plus `stall` seconds on the calls listed in `stalled` (0-based)."""

    def __init__(self, stalled: set[int], stall: float) -> None:
        self.now, self.calls, self.stalled, self.stall = 0.0, 0, stalled, stall

    def perf_counter(self) -> float:
        return self.now

    def run(self, n: int) -> None:
        self.now += PREFILL_S + n * TOKEN_S + (self.stall if self.calls in self.stalled else 0)
        self.calls += 1


def _patched(
    import_benchmark: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> ModuleType:
    offline = import_benchmark("offline_throughput")
    monkeypatch.setattr(offline.time, "perf_counter", clock.perf_counter)
    return offline


def test_a_stalled_short_run_does_not_make_the_figure_absurd(
    import_benchmark: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first (short) run held up for as long as the long run's extra tokens take
    clock = FakeClock(stalled={0}, stall=64 * TOKEN_S)
    offline = _patched(import_benchmark, monkeypatch, clock)
    assert offline._single_stream(clock.run) == pytest.approx(1 / TOKEN_S)


def test_no_positive_difference_gives_nan_not_a_huge_rate(
    import_benchmark: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    # every short run stalled past the long ones: no usable difference
    clock = FakeClock(stalled={0, 2, 4}, stall=1.0)
    offline = _patched(import_benchmark, monkeypatch, clock)
    assert math.isnan(offline._single_stream(clock.run))
