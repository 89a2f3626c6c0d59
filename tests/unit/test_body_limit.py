"""BodySizeLimit at the ASGI level: every framing of a body is held to the limit."""

from __future__ import annotations

import asyncio
from typing import Any

from minisgl.server.body_limit import BodySizeLimit

LIMIT = 1000


def _call(headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, int]:
    """(response status, body bytes the inner app read) for a request sent as `chunks`."""
    read = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal read
        while True:
            msg = await receive()
            read += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(BodySizeLimit(app, LIMIT)(scope, receive, send))
    return sent[0]["status"], read


def test_small_bodies_pass_whatever_their_framing() -> None:
    assert _call([(b"content-length", b"600")], [b"x" * 600]) == (200, 600)
    assert _call([(b"transfer-encoding", b"chunked")], [b"x" * 400] * 2) == (200, 800)


def test_declared_length_over_the_limit_is_refused() -> None:
    assert _call([(b"content-length", b"1001")], [b"x" * 1001]) == (413, 0)
    assert _call([(b"content-length", b"junk")], [b"x"]) == (413, 0)


def test_chunked_body_over_the_limit_is_refused() -> None:
    assert _call([(b"transfer-encoding", b"chunked")], [b"x" * 600] * 2) == (413, 0)


def test_small_content_length_with_a_large_chunked_body_is_refused() -> None:
    # The HTTP server frames by Transfer-Encoding when both are sent: the declared 10 bytes
    # say nothing about what arrives, so the bytes themselves must be counted.
    headers = [(b"content-length", b"10"), (b"transfer-encoding", b"chunked")]
    assert _call(headers, [b"x" * 600] * 40) == (413, 0)
