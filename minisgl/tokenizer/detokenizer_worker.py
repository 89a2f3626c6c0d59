"""Detokenizer worker: token ids -> new complete text per request, stop strings applied.

It is the last stage before the API server, so it is where a request's final reply is made:
exactly one per request (finished, stopped, aborted or rejected), and outputs arriving later
for a request it no longer tracks are dropped (no stale message after EOS or abort).
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl import timeline
from minisgl.message import detokenizer_to_api, scheduler_to_detokenizer, tokenizer_to_scheduler
from minisgl.message.api_to_tokenizer import AbortRequest, Ping
from minisgl.message.detokenizer_to_api import ErrorReply, TextBatch, TextOutput
from minisgl.message.endpoints import Endpoints
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.scheduler_to_detokenizer import (
    RequestEnded,
    RequestRegistered,
    SchedulerStatsUpdate,
    TokenBatch,
    TokenOutput,
)
from minisgl.process import (
    WorkerLife,
    elapsed,
    exit_now,
    report_failure,
    report_ready,
    setup_logging,
)
from minisgl.tokenizer.incremental import IncrementalDecoder
from minisgl.tokenizer.tokenizer_worker import load_tokenizer
from minisgl.tokenizer.without_torch import keep_torch_out


class Detokenizer:
    """The worker's state machine, separate from the sockets so it is testable in-process."""

    def __init__(self, tokenizer: Any, log: logging.Logger | None = None) -> None:
        self.tokenizer = tokenizer
        self.log = log or logging.getLogger("minisgl.detokenizer")
        self.decoders: dict[str, IncrementalDecoder] = {}

    def handle(self, msg: Any) -> tuple[list[Any], list[AbortRequest]]:
        """Messages for the API server, and aborts for the scheduler (stop string hits)."""
        if isinstance(msg, TokenBatch):
            return self._tokens(msg.outputs)
        if isinstance(msg, RequestRegistered):
            self.decoders[msg.rid] = IncrementalDecoder(
                self.tokenizer,
                stop=msg.stop,
                hidden_token_ids=msg.hidden_token_ids,
                skip_special_tokens=msg.skip_special_tokens,
                include_stop_str_in_output=msg.include_stop_str_in_output,
            )
            return [], []
        if isinstance(msg, RequestEnded):
            dec = self.decoders.pop(msg.rid, None)
            if msg.reason == "error":
                return [ErrorReply(msg.rid, msg.message, msg.status, msg.param)], []
            if dec is None:
                return [], []  # already finished: its final reply went out
            done = TextOutput(msg.rid, "", True, "abort", 0, 0, dec.num_tokens)
            return [TextBatch([done])], []
        if isinstance(msg, Ping):
            msg.hops.append("detokenizer")
            return [msg], []
        if isinstance(msg, SchedulerStatsUpdate):
            # Requests this stage still tracks: 0 when idle, or a request's state leaked here.
            msg.stats["detokenizer_live_requests"] = len(self.decoders)
            return [msg], []
        return [], []

    def _tokens(self, outputs: list[TokenOutput]) -> tuple[list[Any], list[AbortRequest]]:
        texts: list[TextOutput] = []
        aborts: list[AbortRequest] = []
        for out in outputs:
            dec = self.decoders.get(out.rid)
            if dec is None:
                continue  # stopped by a stop string or aborted: nothing after the final reply
            delta = dec.feed(out.token_ids, finished=out.finished, finish_reason=out.finish_reason)
            finished = out.finished or dec.stopped
            reason = "stop" if dec.stopped else out.finish_reason
            if dec.stopped and not out.finished:
                aborts.append(AbortRequest(out.rid))  # the engine would keep generating
            if finished:
                del self.decoders[out.rid]
                self.log.debug("rid=%s finished (%s)", out.rid, reason)
            if timeline.enabled() and out.queue_time is not None:
                timeline.mark(out.rid, "detokenized")
            if delta or finished or out.queue_time is not None:
                texts.append(
                    TextOutput(
                        out.rid,
                        delta,
                        finished,
                        reason if finished else None,
                        out.prompt_tokens,
                        out.cached_tokens,
                        dec.num_tokens,
                        out.queue_time,
                    )
                )
        return ([TextBatch(texts)] if texts else []), aborts


def run_detokenizer_worker(
    model: str, endpoints: Endpoints, ready: Connection, log_level: str
) -> None:
    keep_torch_out()
    log = setup_logging(log_level, "detokenizer")
    life = WorkerLife()
    start = time.perf_counter()
    try:
        detok = Detokenizer(load_tokenizer(model), log)
        ctx = zmq.Context()
        inbox: PullQueue[Any] = PullQueue(
            ctx, endpoints.detokenizer, scheduler_to_detokenizer.KINDS
        )
        to_api: PushQueue[Any] = PushQueue(ctx, endpoints.api, detokenizer_to_api.KINDS)
        to_scheduler: PushQueue[Any] = PushQueue(
            ctx, endpoints.scheduler, tokenizer_to_scheduler.KINDS
        )
    except BaseException as exc:
        report_failure(ready, exc)
        raise
    life.serving()
    log.info("detokenizer loaded in %s (pid %d)", elapsed(start), os.getpid())
    report_ready(ready, pid=os.getpid())
    while life.alive():
        for msg in inbox.get_all(timeout=0.1):
            try:
                replies, aborts = detok.handle(msg)
            except Exception:  # a bug for one request must not take the server down
                log.exception("detokenizer failed on %s", type(msg).__name__)
                continue
            for abort in aborts:
                to_scheduler.put(abort)
            for reply in replies:
                to_api.put(reply)
    inbox.close()
    to_api.close()
    to_scheduler.close()
    exit_now()
