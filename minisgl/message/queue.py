"""Typed ZMQ PUSH/PULL wrappers: one PULL binds per process, any number of PUSH connect.

Each queue names the message classes it carries; a receiver rejects anything else, so a
wiring mistake shows up as a clear error instead of a confusing attribute error later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq

from minisgl.message.codec import decode, encode

T = TypeVar("T")
# As plain ints: pyzmq's enums cost a construction per test of a flag.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


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
    """Receiving end for the asyncio API server: every message, in order, handed to a callback
    from the event loop as soon as its socket is readable.

    A plain socket watched by the loop (add_reader on ZMQ's notification descriptor, drained
    until ZMQ says nothing is left), not zmq.asyncio's awaitable recv: that creates a future,
    re-registers the socket and converts its event flags to enums for every message, about half
    of the API server's CPU time per streamed token (a served single stream on a 2-core AMD EPYC
    Zen 4, py-spy), time the compute threads lose on a machine with few cores."""

    def __init__(self, ctx: zmq.Context, endpoint: str, kinds: tuple[type, ...]) -> None:
        self.kinds = kinds
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, on_message: Callable[[T], None], on_error: Callable[[Exception], None]) -> None:
        """Deliver every message to `on_message` from the running loop; a message that does not
        decode, is of a kind this queue does not carry or that `on_message` raises on goes to
        `on_error`, and the messages after it are still delivered."""
        self._on_message, self._on_error = on_message, on_error
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.socket.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)  # what arrived before the reader was added

    def _drain(self) -> None:
        # ZMQ's descriptor is edge-triggered: it signals again only once everything queued has
        # been taken, so read until EVENTS has no POLLIN.
        while self._loop is not None and self.socket.getsockopt(_EVENTS) & _POLLIN:
            data = self.socket.recv(zmq.NOBLOCK)
            try:
                self._on_message(_check(decode(data), self.kinds))
            except Exception as exc:
                self._on_error(exc)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.socket.getsockopt(zmq.FD))
        self._loop = None
        self.socket.close(linger=0)
