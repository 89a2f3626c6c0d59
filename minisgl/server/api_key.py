"""ASGI middleware: the API key check (--api-key), as plain ASGI rather than Starlette's
`@app.middleware("http")`. That decorator wraps every request in BaseHTTPMiddleware, which runs
the app in a task of its own and passes each response chunk through a memory stream between
two tasks: measured ~1 ms of the API server's CPU per streamed request on a 2-core machine,
on the path of every first token. Here an allowed request goes straight through."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minisgl.server.errors import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# With a key set, these need it (/openapi.json too: even the API's shape is for key holders).
GUARDED_PREFIXES = ("/v1", "/internal", "/tokenize", "/detokenize")


def guarded(path: str, metrics_require_key: bool) -> bool:
    if path.startswith(GUARDED_PREFIXES) or path == "/openapi.json":
        return True
    return path == "/metrics" and metrics_require_key


class APIKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str | None, metrics_require_key: bool) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics_require_key = metrics_require_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is not None
            and scope["type"] == "http"
            and guarded(scope["path"], self.metrics_require_key)
        ):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key (Authorization: Bearer)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
