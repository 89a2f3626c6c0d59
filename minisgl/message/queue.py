"""Typed ZMQ PUSH/PULL wrappers: one PULL binds per process, any number of PUSH connect.

Each queue names the message classes it carries; a receiver rejects anything else, so a
wiring mistake shows up as a clear error instead of a confusing attribute error later.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from minisgl.message.codec import decode, encode

T = TypeVar("T")


def _check(msg: Any, kinds: tuple[type, ...]) -> Any:
    if not isinstance(msg, kinds):
        names = ", ".join(k.__name__ for k in kinds)
        raise TypeError(f"unexpected message {type(msg).__name__} (expected {names})")
    return msg


class PushQueue(Generic[T]):
    """Sending end. PUSH only queues locally, so put() does not wait for the receiver."""

    def __init__(self, ctx: zmq.Context, endpoint: str, kinds: tuple[type, ...]) -> None:
        self.kinds = kinds
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def put(self, msg: T) -> None:
        self.socket.send(encode(_check(msg, self.kinds)), copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class PullQueue(Generic[T]):
    """Receiving end for worker loops (blocking with a timeout)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, kinds: tuple[type, ...]) -> None:
        self.kinds = kinds
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)

    def get(self, timeout: float | None = None) -> T | None:
        """Next message, or None when none arrived within `timeout` seconds (None: wait)."""
        if timeout is not None:
            ms = max(0, int(timeout * 1000))
            if not self.socket.poll(ms, zmq.POLLIN):
                return None
        return _check(decode(self.socket.recv(copy=True)), self.kinds)

    def get_all(self, timeout: float | None = None) -> list[T]:
        """Everything queued now, waiting up to `timeout` for the first one."""
        first = self.get(timeout)
        if first is None:
            return []
        out = [first]
        while self.socket.poll(0, zmq.POLLIN):
            out.append(_check(decode(self.socket.recv(copy=True)), self.kinds))
        return out

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncPullQueue(Generic[T]):
    """Receiving end for the asyncio API server."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, kinds: tuple[type, ...]) -> None:
        self.kinds = kinds
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)

    async def get(self) -> T:
        data = await self.socket.recv(copy=True)
        return _check(decode(data), self.kinds)

    def close(self) -> None:
        self.socket.close(linger=0)
