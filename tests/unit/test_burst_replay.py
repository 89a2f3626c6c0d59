"""burst_replay.py: the scheduler replayed on a step-cost curve (no model): one step per burst
without chunks, earlier first tokens with them, and a prefill no longer than the overhead
allows on a line."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def burst_replay(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("burst_replay")


def test_chunks_bring_first_tokens_forward_at_a_bounded_cost(burst_replay) -> None:
    line = burst_replay.parse_curve("1:50,10000:7050")  # 50 ms a step + 0.7 ms a row
    whole, whole_ms = burst_replay.replay(8, 4, 0.0, line)
    assert len(set(whole)) == 1  # one prefill step: every request waits for all of it
    chunked, chunked_ms = burst_replay.replay(8, 4, 0.25, line)
    assert chunked[0] < whole[0] and sorted(chunked) == chunked  # arrival order
    prefill = 50 + 0.7 * 8 * 128
    assert chunked[-1] <= 1.25 * prefill + 0.7 * 8 * 4  # + the decodes riding along
    assert chunked_ms < 1.25 * whole_ms
