"""Generation requests between their arrival and their hand-off to the tokenizer.

The scheduler prefills the requests of a burst (several clients at once) together, and starts a
lone request's prefill at once; it tells the two apart by the `more` flag each request carries
from here: set when other generation requests had arrived at this server and were not handed
on yet. The count starts at the outermost ASGI layer, so a request is counted as soon as the
server begins on it, before its body is parsed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Arrivals:
    """How many generation requests this server holds that were not handed on yet."""

    def __init__(self) -> None:
        self.count = 0


class Arrival:
    """One request's place in the count, given up once (handed on, or failed before)."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.counted = True
        arrivals.count += 1

    def leave(self) -> None:
        if self.counted:
            self.counted = False
            self.arrivals.count -= 1


class CountArrivals:
    """ASGI middleware (outermost): counts each generation request from the moment it starts."""

    def __init__(self, app: ASGIApp, arrivals: Arrivals) -> None:
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        arrival = Arrival(self.arrivals)
        scope.setdefault("state", {})["arrival_count"] = arrival
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.leave()


async def more_behind(arrivals: Arrivals, arrival: Arrival | None, idle: bool) -> bool:
    """Leaves the count for a request about to be handed on; whether others are behind it.

    On an idle server this request may be the first of a burst whose other requests arrived
    with it: one turn of the event loop lets those start (and be counted) before the answer."""
    if idle:
        await asyncio.sleep(0)
    if arrival is not None:
        arrival.leave()
    return arrivals.count > 0
