"""The API server's side of the pipeline: sends requests to the tokenizer, routes replies back.

The PULL socket from the detokenizer (and the tokenizer's error replies) is read by the event
loop itself, which hands each message to the asyncio.Queue of its request. Sending is a plain
(synchronous) PUSH: it only copies into ZMQ's queue, so it never blocks the event loop and can
be called from a `finally` during cancellation, which is where client-disconnect aborts come
from.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl.message import api_to_tokenizer, detokenizer_to_api
from minisgl.message.api_to_tokenizer import AbortRequest, Heartbeat, Ping, TokenizeRequest
from minisgl.message.detokenizer_to_api import (
    ErrorReply,
    RequestAccepted,
    TextBatch,
    TextOutput,
    TokenizerReply,
)
from minisgl.message.endpoints import Endpoints
from minisgl.message.queue import AsyncPullQueue, PushQueue
from minisgl.message.scheduler_to_detokenizer import SchedulerStatsUpdate
from minisgl.structured.spec import KIND_FIELDS

log = logging.getLogger("minisgl.api")

Reply = TextOutput | ErrorReply | TokenizerReply


@dataclass
class RequestState:
    rid: str
    arrival_time: float
    queue: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)
    # Samples with no output yet: each counts as a waiting sequence (admission control).
    waiting: set[int] = field(default_factory=lambda: {0})
    # Set once the engine accepted the request or it failed (then `error` says why).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    error: ErrorReply | None = None
    grammar_field: str | None = None  # the request field its grammar came from, if any


class RequestManager:
    def __init__(self, endpoints: Endpoints, metrics: Any) -> None:
        self.endpoints = endpoints
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self.stats: dict[str, Any] = {}
        self.stats_time = 0.0  # time.time() the last scheduler stats arrived
        self.recent_batch_sizes: collections.deque[int] = collections.deque(maxlen=4096)
        self.max_batch_size = 0
        self.batch_steps = 0  # steps reported so far (recent_batch_sizes keeps only the tail)
        self._pings: dict[int, asyncio.Future[list[str]]] = {}
        self._ping_ids = itertools.count(1)
        self._beat_ids = itertools.count(1)
        self._beat_sent: dict[int, float] = {}  # heartbeats to the tokenizer not answered yet

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.Context()
        self.inbox: AsyncPullQueue[Any] = AsyncPullQueue(
            self._ctx, self.endpoints.api, detokenizer_to_api.KINDS
        )
        self.to_tokenizer: PushQueue[Any] = PushQueue(
            self._ctx, self.endpoints.tokenizer, api_to_tokenizer.KINDS
        )
        self.inbox.start(self._dispatch, _reply_failed)

    def close(self) -> None:
        self.inbox.close()
        self.to_tokenizer.close()

    # ---- requests ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences (samples of requests) accepted here that have no output yet."""
        return sum(len(s.waiting) for s in self.requests.values())

    def submit(self, req: TokenizeRequest, grammar_field: str | None = None) -> RequestState:
        # Encode first: a request that cannot be sent must not stay registered (it would
        # count as waiting forever and, with enough of them, close admission for good).
        self.to_tokenizer.put(req)
        state = RequestState(
            req.rid, req.arrival_time, waiting=set(range(req.params.n)), grammar_field=grammar_field
        )
        self.requests[req.rid] = state  # no await since put(): no reply can come before this
        return state

    async def text_tool(self, msg: Any, timeout: float = 60.0) -> Reply:
        """Send a TokenizeOnly/DetokenizeOnly to the tokenizer worker and await its reply."""
        state = RequestState(msg.rid, time.time())
        self.to_tokenizer.put(msg)
        self.requests[msg.rid] = state
        try:
            return await asyncio.wait_for(state.queue.get(), timeout)
        finally:
            self.requests.pop(msg.rid, None)

    def release(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Drop a request still in flight; the scheduler frees its pages."""
        if self.requests.pop(rid, None) is not None:
            self.to_tokenizer.put(AbortRequest(rid))

    @property
    def pending_pings(self) -> dict[int, asyncio.Future[list[str]]]:
        return self._pings

    def fail_all(self, message: str, status: int = 503) -> None:
        for state in list(self.requests.values()):
            state.queue.put_nowait(ErrorReply(state.rid, message, status))

    async def ping(self, timeout: float) -> list[str]:
        """Round trip through every worker; returns the stages it went through."""
        ping_id = next(self._ping_ids)
        fut: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = fut
        self.to_tokenizer.put(Ping(ping_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pings.pop(ping_id, None)

    def heartbeat(self) -> None:
        """Ask the tokenizer worker to answer at once (one question at a time)."""
        if not self._beat_sent:
            beat = next(self._beat_ids)
            self._beat_sent[beat] = time.monotonic()
            self.to_tokenizer.put(Heartbeat(beat))

    def tokenizer_silence(self) -> float:
        """Seconds the tokenizer worker has left a heartbeat unanswered (0: none pending)."""
        if not self._beat_sent:
            return 0.0
        return time.monotonic() - min(self._beat_sent.values())

    # ---- replies ----------------------------------------------------------------------------
    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextBatch):
            for out in msg.outputs:
                self._deliver(out.rid, out)
        elif isinstance(msg, ErrorReply | TokenizerReply):
            self._deliver(msg.rid, msg)
        elif isinstance(msg, RequestAccepted):
            state = self.requests.get(msg.rid)
            if state is not None:
                state.settled.set()
        elif isinstance(msg, SchedulerStatsUpdate):
            self._on_stats(msg)
        elif isinstance(msg, Heartbeat):
            self._beat_sent.pop(msg.beat_id, None)
        elif isinstance(msg, Ping):
            fut = self._pings.get(msg.ping_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.hops)

    def _deliver(self, rid: str, reply: Reply) -> None:
        state = self.requests.get(rid)
        if state is None:
            return  # the client is gone (aborted): nothing to deliver to
        if isinstance(reply, TextOutput):
            state.waiting.discard(reply.index)
        else:
            state.waiting.clear()
        if isinstance(reply, ErrorReply):
            reply = _named(reply, state.grammar_field)
        if isinstance(reply, ErrorReply) and state.error is None:
            state.error = reply
        state.settled.set()
        state.queue.put_nowait(reply)

    def _on_stats(self, msg: SchedulerStatsUpdate) -> None:
        self.stats = dict(msg.stats)
        self.stats_time = time.time()
        self.recent_batch_sizes.extend(msg.batch_sizes)
        self.batch_steps += len(msg.batch_sizes)
        if msg.batch_sizes:
            self.max_batch_size = max(self.max_batch_size, *msg.batch_sizes)
        try:
            self.metrics.update_scheduler(
                {
                    **msg.stats,
                    "batch_sizes": list(msg.batch_sizes),
                    "spec_accept_lengths": list(msg.accept_lengths),
                }
            )
        except Exception:
            log.exception("metrics update failed")


def _reply_failed(exc: Exception) -> None:
    log.error("a message from a worker failed: %r", exc, exc_info=exc)


# The fields a grammar's 400 names from the scheduler, which knows only the grammar's kind.
_KIND_PARAMS = frozenset(KIND_FIELDS.values())


def _named(reply: ErrorReply, grammar_field: str | None) -> ErrorReply:
    """A grammar's 400 naming the request field that gave the grammar (a tool's parameters
    or guided_json compile as a json_schema, which the scheduler calls response_format)."""
    param = reply.param
    if grammar_field is None or param is None or param == grammar_field:
        return reply
    if param not in _KIND_PARAMS:
        return reply
    message = reply.message
    if message.startswith(param) and message[len(param) : len(param) + 1] in (" ", ":"):
        message = grammar_field + message[len(param) :]  # "regex is invalid", "regex: ..."
    return ErrorReply(reply.rid, message, reply.status, grammar_field)
