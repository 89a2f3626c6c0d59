"""The scheduler worker's speculative-decoding accounting: each request's verify in a step counts
its drafts and kept drafts, the stats report carries running totals and the kept-per-verify
counts since the last report, and the API server's metrics turn them into the series."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from metrics_text import value

from minisgl.engine.engine import StepOutput
from minisgl.engine.worker import SchedulerLoop
from minisgl.message.scheduler_to_detokenizer import SchedulerStatsUpdate
from minisgl.metrics import ServerMetrics
from minisgl.metrics import names as n
from minisgl.scheduler.scheduler import SchedulerStats


class Engine:
    def __init__(self, steps: list[list[StepOutput]]) -> None:
        self.steps = steps

    def step(self) -> list[StepOutput]:
        return self.steps.pop(0)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(1, 0, 10, 5, 5, 0, 0, 0, 0, 2)


class Sink:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


def out(rid: str, tokens: list[int], drafts: int, kept: int) -> StepOutput:
    return StepOutput(rid, tokens, False, None, 3, 0, 1, spec_draft_tokens=drafts,
                      spec_accepted_tokens=kept)  # fmt: skip


def test_verifies_become_totals_and_accept_lengths() -> None:
    steps = [
        [out("a", [1, 2, 3, 4, 5], 4, 4), out("b", [7], 0, 0)],  # b had no draft: no verify
        [out("a", [6], 3, 0), out("b", [8, 9], 2, 1)],
        [out("a", [10, 11], 4, 1)],
    ]
    sink = Sink()
    loop = SchedulerLoop(Engine(steps), None, sink, logging.getLogger("t"))  # type: ignore[arg-type]
    loop.step()
    loop.step()
    loop.send_stats()
    loop.step()
    loop.send_stats()
    first, second = [m for m in sink.sent if isinstance(m, SchedulerStatsUpdate)]
    assert first.stats["spec_draft_tokens_total"] == 9
    assert first.stats["spec_accepted_tokens_total"] == 5
    assert first.accept_lengths == [1, 1, 0, 0, 1]  # kept 0, 1 and 4
    assert second.stats["spec_draft_tokens_total"] == 13  # running totals
    assert second.accept_lengths == [0, 1]  # only what came since
    metrics = ServerMetrics("m")
    for msg in (first, second):
        metrics.update_scheduler({**msg.stats, "spec_accept_lengths": msg.accept_lengths})
    body = metrics.render()[0]
    assert value(body, n.SPEC_DRAFT_TOKENS) == 13
    assert value(body, n.SPEC_ACCEPTED_TOKENS) == 6
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_count") == 4
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_sum") == 6


def test_the_stats_message_round_trips_its_accept_lengths() -> None:
    from minisgl.message.codec import decode, encode

    msg = SchedulerStatsUpdate({"num_running": 1}, [2], 1.5, [3, 0, 2])
    back = decode(encode(msg))
    assert dataclasses.asdict(back) == dataclasses.asdict(msg)
    assert back.accept_lengths == [3, 0, 2]
