"""serving_timeline.py --burst: a burst's steps read back from the timeline (which requests each
step began and gave their first token), without a server."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def serving_timeline(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("serving_timeline")


def test_a_burst_split_over_two_steps_shows_who_waited(serving_timeline) -> None:
    def req(received: float, step: tuple[float, float]) -> list[tuple[str, float]]:
        # As the scheduler marks them: just before the step begins, just after it ends.
        return [
            ("received", received),
            ("scheduled", step[0] - 1e-5),
            ("forwarded", step[1] + 1e-5),
        ]

    first, second = (10.0, 10.3), (10.31, 11.0)
    events = {
        "a": req(10.0, first),
        "b": req(10.001, first),
        "c": req(10.002, second),  # arrived while the first step was being set up
    }
    steps = [("step_begin", 9.0), ("step_end", 9.1)]  # before the burst: not shown
    steps += [("step_begin", first[0]), ("step_end", first[1])]
    steps += [("step_begin", second[0]), ("step_end", second[1])]
    got = serving_timeline.burst_steps(events, steps)
    assert [(round(s, 3), round(n, 3), b, g) for s, n, b, g in got] == [
        (0.0, 0.3, 2, 2),
        (0.31, 0.69, 1, 1),
    ]
