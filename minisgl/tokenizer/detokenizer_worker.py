"""Detokenizer worker: token ids -> new complete text per request, stop strings applied.

It is the last stage before the API server, so it is where a request's final reply is made:
exactly one per request (finished, stopped, aborted or rejected), and outputs arriving later
for a request it no longer tracks are dropped (no stale message after EOS or abort).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl import timeline
from minisgl.logprobs import TokenLogprobs
from minisgl.message import detokenizer_to_api, scheduler_to_detokenizer, tokenizer_to_scheduler
from minisgl.message.api_to_tokenizer import AbortRequest, Ping
from minisgl.message.detokenizer_to_api import (
    ErrorReply,
    LogprobsText,
    RequestAccepted,
    TextBatch,
    TextOutput,
)
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
from minisgl.structured.tags import special_tags, special_token_ids
from minisgl.tokenizer.incremental import IncrementalDecoder
from minisgl.tokenizer.token_text import TokenTexts
from minisgl.tokenizer.tokenizer_worker import load_tokenizer
from minisgl.tokenizer.without_torch import keep_torch_out


@dataclass
class _Live:
    """A request the detokenizer still answers for: one decoder per live sample."""

    samples: dict[int, IncrementalDecoder]
    echo_ids: list[int] | None  # prompt to decode into the first reply (echo of an ids prompt)
    skip_special_tokens: bool


class Detokenizer:
    """The worker's state machine, separate from the sockets so it is testable in-process."""

    def __init__(self, tokenizer: Any, log: logging.Logger | None = None) -> None:
        self.tokenizer = tokenizer
        self.log = log or logging.getLogger("minisgl.detokenizer")
        self.decoders: dict[str, _Live] = {}
        self.token_texts = TokenTexts(tokenizer)
        self.special_ids = special_token_ids(tokenizer)

    def handle(self, msg: Any) -> tuple[list[Any], list[AbortRequest]]:
        """Messages for the API server, and aborts for the scheduler (stop string hits)."""
        if isinstance(msg, TokenBatch):
            return self._tokens(msg.outputs)
        if isinstance(msg, RequestRegistered):
            samples = {
                i: IncrementalDecoder(
                    self.tokenizer,
                    stop=msg.stop,
                    hidden_token_ids=msg.hidden_token_ids,
                    skip_special_tokens=msg.skip_special_tokens,
                    include_stop_str_in_output=msg.include_stop_str_in_output,
                    skip_ids=self._skip_ids(msg),
                    min_tokens=msg.min_tokens,
                )
                for i in range(msg.n)
            }
            self.decoders[msg.rid] = _Live(samples, msg.echo_ids, msg.skip_special_tokens)
            # The API server may wait for this before it commits to a reply (a prompt list's
            # stream answers 400 until every prompt is accepted).
            return [RequestAccepted(msg.rid)], []
        if isinstance(msg, RequestEnded):
            return self._ended(msg), []
        if isinstance(msg, Ping):
            msg.hops.append("detokenizer")
            return [msg], []
        if isinstance(msg, SchedulerStatsUpdate):
            # Requests this stage still tracks: 0 when idle, or a request's state leaked here.
            msg.stats["detokenizer_live_requests"] = len(self.decoders)
            return [msg], []
        return [], []

    def _skip_ids(self, msg: RequestRegistered) -> frozenset[int] | None:
        """The special tokens to skip when some are kept (None: the tokenizer's own rule)."""
        if not msg.skip_special_tokens or not msg.keep_special:
            return None
        kept = {self.tokenizer.convert_tokens_to_ids(t) for t in msg.keep_special}
        return self.special_ids - kept if kept & self.special_ids else None

    def _ended(self, msg: RequestEnded) -> list[Any]:
        if msg.reason == "error":
            self.decoders.pop(msg.rid, None)
            return [ErrorReply(msg.rid, msg.message, msg.status, msg.param)]
        live = self.decoders.get(msg.rid)
        if live is None:
            return []  # already finished: its final reply went out
        which = list(live.samples) if msg.index is None else [msg.index]
        done = []
        for i in which:
            dec = live.samples.pop(i, None)
            if dec is not None:  # else that sample already ended
                done.append(TextOutput(msg.rid, "", True, "abort", 0, 0, dec.num_tokens, index=i))
        if not live.samples:
            del self.decoders[msg.rid]
        return [TextBatch(done)] if done else []

    def _tokens(self, outputs: list[TokenOutput]) -> tuple[list[Any], list[AbortRequest]]:
        texts: list[TextOutput] = []
        aborts: list[AbortRequest] = []
        for out in outputs:
            live = self.decoders.get(out.rid)
            dec = live.samples.get(out.index) if live is not None else None
            if live is None or dec is None:
                continue  # stopped by a stop string or aborted: nothing after the final reply
            before = dec.num_tokens
            delta = dec.feed(out.token_ids, finished=out.finished, finish_reason=out.finish_reason)
            used = dec.num_tokens - before  # fewer when a stop string ended a run of tokens
            logprobs = out.logprobs
            if logprobs is not None and used < len(logprobs):
                logprobs = logprobs.head(used)
            finished = out.finished or dec.stopped
            reason = "stop" if dec.stopped else out.finish_reason
            if dec.stopped and not out.finished:
                # The engine would keep generating this sample.
                aborts.append(AbortRequest(out.rid, out.index if len(live.samples) > 1 else None))
            prompt_text = None
            if live.echo_ids is not None:
                prompt_text = self.tokenizer.decode(
                    live.echo_ids, skip_special_tokens=live.skip_special_tokens
                )
                live.echo_ids = None
            if finished:
                del live.samples[out.index]
                if not live.samples:
                    del self.decoders[out.rid]
                self.log.debug("rid=%s finished (%s)", out.rid, reason)
            if timeline.enabled() and out.queue_time is not None:
                timeline.mark(out.rid, "detokenized")
            extras = logprobs is not None or out.prompt_logprobs is not None
            extras = extras or prompt_text is not None
            if delta or finished or out.queue_time is not None or extras:
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
                        out.index,
                        self._logprobs(logprobs),
                        self._logprobs(out.prompt_logprobs),
                        prompt_text,
                    )
                )
        return ([TextBatch(texts)] if texts else []), aborts

    def _logprobs(self, lp: TokenLogprobs | None) -> LogprobsText | None:
        if lp is None or not lp.token_ids:
            return None if lp is None else LogprobsText([], [], [], [], [], [])
        return self.token_texts.logprobs_text(lp)


def run_detokenizer_worker(
    model: str, endpoints: Endpoints, ready: Connection, log_level: str
) -> None:
    keep_torch_out()
    log = setup_logging(log_level, "detokenizer")
    life = WorkerLife(endpoints.root)
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
    # The API server learns here which parser tags are special tokens (ChatOutput drops those
    # its parsers leave over).
    report_ready(ready, pid=os.getpid(), special_tags=special_tags(detok.tokenizer))
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
