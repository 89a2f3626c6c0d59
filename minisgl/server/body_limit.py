"""ASGI middleware: refuse request bodies over --max-request-body-bytes before anything reads
them whole. A declared Content-Length over the limit is refused up front; every body, whatever
its framing, is also counted as it arrives and never buffered past the limit (the declared
length alone is not trusted: with both Content-Length and Transfer-Encoding the HTTP server
frames the body by the chunks, so the bytes that arrive may far exceed the declared length)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minisgl.server.errors import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Arrival as early as possible, so metrics count the parsing time too.
        scope.setdefault("state", {})["arrival"] = time.time()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not (length.isdigit() and int(length) <= self.max_bytes):
            await self._refuse(scope, receive, send)  # before a byte of the body is read
            return
        buffered: list[Message] = []
        size = 0
        while True:
            msg = await receive()
            buffered.append(msg)
            if msg["type"] != "http.request":
                break  # the client went away: the app sees the disconnect
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body larger than {self.max_bytes} bytes")
        await response(scope, receive, send)
