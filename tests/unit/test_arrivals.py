"""The `more` hint that lets the scheduler start a lone request's prefill at once and still
prefill a burst together: the API server counts generation requests it has not handed on,
the tokenizer adds the ones queued behind the request in hand."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

from minisgl.message.api_to_tokenizer import TokenizeRequest
from minisgl.sampling_params import SamplingParams
from minisgl.server.arrivals import Arrival, Arrivals, CountArrivals, more_behind
from minisgl.tokenizer.tokenizer_worker import TokenizerLoop


def test_a_burst_says_more_until_its_last_request() -> None:
    """Requests that arrived together: each but the last is handed on saying more follow."""
    arrivals = Arrivals()
    answers: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        idle = not answers  # the first request finds the server idle
        answers.append(await more_behind(arrivals, scope["state"]["arrival_count"], idle))

    counted = CountArrivals(app, arrivals)

    async def burst(n: int) -> None:
        scope = {"type": "http", "path": "/v1/completions"}
        await asyncio.gather(*(counted(dict(scope), None, None) for _ in range(n)))  # type: ignore[arg-type]

    asyncio.run(burst(3))
    assert answers == [True, True, False]
    assert arrivals.count == 0


def test_a_lone_request_says_nothing_follows_and_leaves_the_count_once() -> None:
    arrivals = Arrivals()
    arrival = Arrival(arrivals)
    assert asyncio.run(more_behind(arrivals, arrival, idle=True)) is False
    arrival.leave()  # the middleware's own leave at the end of the response
    assert arrivals.count == 0


def test_other_paths_are_not_counted() -> None:
    arrivals = Arrivals()
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(arrivals.count)

    asyncio.run(CountArrivals(app, arrivals)({"type": "http", "path": "/health"}, None, None))  # type: ignore[arg-type]
    assert seen == [0]


def test_the_tokenizer_marks_a_request_with_others_queued_behind_it() -> None:
    sent: list[Any] = []
    loop = TokenizerLoop(None, SimpleNamespace(put=sent.append), None, None, logging.getLogger("t"))

    def req(rid: str, more: bool = False) -> TokenizeRequest:
        return TokenizeRequest(rid, 0.0, SamplingParams(), 4, prompt_ids=[1, 2], more=more)

    loop.queued_behind = 1
    loop.handle(req("a"))
    loop.queued_behind = 0
    loop.handle(req("b"))
    loop.handle(req("c", more=True))  # the API server held more
    assert [(m.rid, m.more) for m in sent] == [("a", True), ("b", False), ("c", True)]
