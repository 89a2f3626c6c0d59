"""Scheduler worker process: owns the Engine and runs its step loop.

Between steps it drains its inbox (new requests, aborts, pings) without waiting, so an abort
frees pages within one step; when idle it blocks on the inbox with a short timeout. Scheduler
stats go out every STATS_INTERVAL seconds, busy or idle, so the API server's gauges stay fresh.
A request whose grammar is not compiled yet waits beside the loop (the engine's compile worker
compiles it) and is added when its grammar is ready, or ends with the compile's 400.

A request's registration with the detokenizer (its stop strings) is held back and sent just
before the next message to the detokenizer, usually the first step's tokens: the detokenizer and
the API server (which it acknowledges) then wake once, after the forward pass, instead of in the
middle of it, where on a machine with few cores they take time from the compute threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl import timeline
from minisgl.config import EngineArgs
from minisgl.message import scheduler_to_detokenizer, tokenizer_to_scheduler
from minisgl.message.api_to_tokenizer import AbortRequest, Ping
from minisgl.message.endpoints import Endpoints
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.scheduler_to_detokenizer import (
    RequestEnded,
    RequestRegistered,
    SchedulerStatsUpdate,
    TokenBatch,
    TokenOutput,
)
from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
from minisgl.process import (
    WorkerLife,
    elapsed,
    exit_now,
    freeze_startup_objects,
    report_failure,
    report_ready,
    setup_logging,
)

STATS_INTERVAL = 0.25  # seconds; the API server's gauges are never older than this plus a step
# Waking from idle with a request that says more are right behind it (TokenizedRequest.more: the
# API server or the tokenizer held others), the loop keeps taking messages for as long as the
# last one taken says so, up to a window, so requests sent together (a client's burst, passing
# the tokenizer one by one) reach one schedule decision rather than the first few alone and the
# rest a step later. A request that misses the decision waits for at least the step it starts,
# so the window is a share of a step (the last one timed: COALESCE_SHARE of it), at least
# COALESCE_MIN and at most COALESCE_MAX. The gaps between a burst's requests are not a sign of
# its end: on a loaded 2-core machine the API server hands a 32-request burst over in tens of
# ms, more than 2 ms apart, and a fixed 6 ms window split one as 9 + 23. A lone request is not
# held up: its prefill starts at once.
COALESCE_SHARE = 0.5
COALESCE_MIN = 0.006
COALESCE_MAX = 0.1
COMPILE_POLL = 0.005  # idle but for grammars compiling: how often to look for them


class SchedulerLoop:
    def __init__(self, engine: Any, inbox: PullQueue, to_detok: PushQueue, log: logging.Logger):
        self.engine = engine
        self.inbox = inbox
        self.to_detok = to_detok
        self.log = log
        self.batch_sizes: list[int] = []
        # Speculative decoding: running totals (the API server turns them into counters) and
        # the verifies since the last report, counted by how many drafts they kept.
        self.spec_draft_tokens_total = 0
        self.spec_accepted_tokens_total = 0
        self.accept_lengths: list[int] = []
        self.last_stats = 0.0
        self.unscheduled: list[str] = []  # added since the last step (timeline only)
        self.compiling: dict[str, TokenizedRequest] = {}  # rid -> request waiting for its grammar
        self.registrations: list[RequestRegistered] = []  # not sent yet: see the module doc
        self.burst_open = False  # the last request taken said more are right behind it
        self.clock = time.monotonic  # the coalescing window's and the steps' timing
        self.last_step_s: float | None = None  # the last engine step's wall time

    def run(self, life: WorkerLife) -> None:
        while life.alive():
            busy = self.engine.has_unfinished()
            idle_wait = COMPILE_POLL if self.compiling else STATS_INTERVAL / 2
            msgs = self.inbox.get_all(timeout=0 if busy else idle_wait)
            for msg in msgs:
                self.handle(msg)
            if msgs and not busy and self.burst_open:
                self.coalesce()
            if self.compiling:
                self.collect_grammars()
            if self.engine.has_unfinished():
                self.step()
            if time.monotonic() - self.last_stats >= STATS_INTERVAL:
                self.send_stats()
            self.flush()  # a registration no step has carried yet (e.g. none ran)

    def send(self, msg: Any) -> None:
        """To the detokenizer, after the registrations held back (they must precede it)."""
        self.flush()
        self.to_detok.put(msg)

    def flush(self) -> None:
        for reg in self.registrations:
            self.to_detok.put(reg)
        self.registrations = []

    def coalesce_window(self) -> float:
        """How long to wait for a burst's announced requests (see COALESCE_SHARE)."""
        if self.last_step_s is None:
            return COALESCE_MIN
        return min(COALESCE_MAX, max(COALESCE_MIN, COALESCE_SHARE * self.last_step_s))

    def coalesce(self) -> None:
        """Take the rest of a burst that woke an idle loop (see COALESCE_SHARE)."""
        deadline = self.clock() + self.coalesce_window()
        while self.burst_open and (left := deadline - self.clock()) > 0:
            for msg in self.inbox.get_all(timeout=left):
                self.handle(msg)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedRequest):
            self.burst_open = msg.more
            self.add(msg)
        elif isinstance(msg, AbortRequest):
            gone = self.compiling.pop(msg.rid, None) if msg.index is None else None
            if gone is not None:
                self.log.info("rid=%s aborted while its grammar compiled", msg.rid)
                self.send(RequestEnded(msg.rid, "abort"))
                key = gone.params.grammar_kind, gone.params.grammar
                if all(
                    (r.params.grammar_kind, r.params.grammar) != key
                    for r in self.compiling.values()
                ):
                    # Nobody waits for it now: it must hold no other grammar up.
                    self.engine.cancel_grammar(key[0] or "", key[1] or "")
            elif self.engine.abort_request(msg.rid, msg.index):
                which = "" if msg.index is None else f" (sample {msg.index})"
                self.log.info("rid=%s aborted%s", msg.rid, which)
                self.send(RequestEnded(msg.rid, "abort", index=msg.index))
        elif isinstance(msg, Ping):
            msg.hops.append("scheduler")
            self.send(msg)

    def add(self, req: TokenizedRequest) -> None:
        engine = self.engine
        params = req.params
        if req.max_tokens is None:
            # No max_tokens: generate up to the end of the context.
            params.max_tokens = max(1, engine.max_seq_len - len(req.prompt_ids))
        else:
            params.max_tokens = req.max_tokens
        grammar = params.grammar_kind, params.grammar or ""
        if params.grammar_kind is not None and not engine.grammar_ready(*grammar):
            try:  # everything but the grammar: a too-long prompt need not wait for a compile
                engine.validate(req.prompt_ids, params, compile_grammar=False)
            except ValueError as exc:
                self.reject(req.rid, exc)
                return
            self.log.info("rid=%s waits for its %s grammar to compile", req.rid, grammar[0])
            self.compiling[req.rid] = req
            engine.request_grammar(*grammar)
            return
        self.admit(req)

    def collect_grammars(self) -> None:
        """Requests whose grammar finished compiling join the engine (or end with its error)."""
        for outcome in self.engine.finished_grammars():
            # One at a time: installing the next grammar may evict this one from the cache.
            if outcome.compiled is not None:
                self.engine.install_grammar(outcome)
            key = (outcome.kind, outcome.value)
            waiting = [
                r
                for r in self.compiling.values()
                if (r.params.grammar_kind, r.params.grammar) == key
            ]
            for req in waiting:
                del self.compiling[req.rid]
                if outcome.error is not None:
                    self.reject(req.rid, outcome.error)
                else:
                    self.admit(req)

    def reject(self, rid: str, exc: ValueError) -> None:
        self.log.info("rid=%s rejected: %s", rid, exc)
        self.send(RequestEnded(rid, "error", str(exc), 400, getattr(exc, "param", None)))

    def admit(self, req: TokenizedRequest) -> None:
        engine = self.engine
        params = req.params
        try:
            engine.add_request(req.rid, req.prompt_ids, params, arrival_time=req.arrival_time)
        except ValueError as exc:
            self.reject(req.rid, exc)
            return
        hidden = list(params.stop_token_ids)
        if not params.ignore_eos:
            hidden += list(engine.eos_token_ids)
        if timeline.enabled():
            timeline.mark(req.rid, "queued")
            self.unscheduled.append(req.rid)
        self.log.info(
            "rid=%s queued: %d prompt tokens, max_tokens=%d",
            req.rid,
            len(req.prompt_ids),
            params.max_tokens,
        )
        # Same socket as the outputs, sent before any of them (send() flushes it first): the
        # detokenizer knows the request's stop strings before its first token arrives.
        self.registrations.append(
            RequestRegistered(
                req.rid,
                list(params.stop),
                hidden,
                req.skip_special_tokens,
                len(req.prompt_ids),
                params.include_stop_str_in_output,
                n=params.n,
                echo_ids=list(req.prompt_ids) if req.echo else None,
                keep_special=list(req.keep_special),
                min_tokens=params.min_tokens,
            )
        )

    def step(self) -> None:
        if timeline.enabled():
            for rid in self.unscheduled:
                timeline.mark(rid, "scheduled")
            self.unscheduled = []
            timeline.mark("-", "step_begin")
        started = self.clock()
        outputs = self.engine.step()
        self.last_step_s = self.clock() - started
        if timeline.enabled():
            timeline.mark("-", "step_end")
            for o in outputs:
                if o.queue_time is not None:
                    timeline.mark(o.rid, "forwarded")
        if not outputs:
            return
        self.batch_sizes.append(self.engine.stats().last_batch_size)
        for o in outputs:
            if o.spec_draft_tokens:
                self.count_verify(o.spec_draft_tokens, o.spec_accepted_tokens)
        batch = [
            TokenOutput(
                o.rid,
                list(o.new_token_ids),
                o.finished,
                o.finish_reason,
                o.prompt_tokens,
                o.cached_tokens,
                o.completion_tokens,
                o.queue_time,
                o.index,
                o.logprobs,
                o.prompt_logprobs,
            )
            for o in outputs
            if o.error is None
        ]
        for o in outputs:
            if o.finished:
                self.log.info(
                    "rid=%s finished (%s): %d tokens", o.rid, o.finish_reason, o.completion_tokens
                )
            if o.error is not None:  # the engine dropped it: its final reply is this error
                self.send(RequestEnded(o.rid, "error", o.error, 500, None))
        if batch:
            self.send(TokenBatch(batch))

    def count_verify(self, drafts: int, kept: int) -> None:
        self.spec_draft_tokens_total += drafts
        self.spec_accepted_tokens_total += kept
        if kept >= len(self.accept_lengths):
            self.accept_lengths += [0] * (kept + 1 - len(self.accept_lengths))
        self.accept_lengths[kept] += 1

    def send_stats(self) -> None:
        stats: dict[str, Any] = dataclasses.asdict(self.engine.stats())
        stats["spec_draft_tokens_total"] = self.spec_draft_tokens_total
        stats["spec_accepted_tokens_total"] = self.spec_accepted_tokens_total
        stats["num_waiting"] += len(self.compiling)  # they wait, for their grammar
        live = getattr(self.engine, "num_live_requests", None)
        if live is not None:  # every per-request map of the engine: 0 when idle, else a leak
            stats["engine_live_requests"] = live()
        rank_stats = getattr(self.engine, "rank_stats", None)
        if rank_stats is not None and not self.engine.has_unfinished():
            # Tensor parallel: every rank's own books, so leaks on any rank show (idle only:
            # the followers answer between steps).
            stats["ranks"] = [dataclasses.asdict(s) for s in rank_stats()]
        self.send(SchedulerStatsUpdate(stats, self.batch_sizes, time.time(), self.accept_lengths))
        self.batch_sizes = []
        self.accept_lengths = []
        self.last_stats = time.monotonic()


def messaging_context(nice: int) -> zmq.Context:
    """The worker's ZMQ context, then `nice` added to this thread, before the model loads: the
    compute threads created from here on inherit it (Linux keeps a nice value per thread).

    libzmq's I/O thread, which moves every message in and out of this process, starts with the
    context's first socket: started here, before the nice, it keeps the launcher's priority.
    Niced, it queued behind the compute threads and the rest of the machine, so a step's
    tokens waited there before reaching the detokenizer (~9 ms median on a busy 2-core Xeon)."""
    ctx = zmq.Context()
    ctx.socket(zmq.PUSH).close()  # starts the I/O thread
    if nice > 0:
        os.nice(nice)
    return ctx


def run_scheduler_worker(
    args: EngineArgs, endpoints: Endpoints, ready: Connection, log_level: str, tp_rank: int = 0
) -> None:
    log = setup_logging(log_level, "scheduler")
    life = WorkerLife(endpoints.root)
    start = time.perf_counter()
    ctx = messaging_context(args.scheduler_nice)
    try:
        from tqdm import tqdm

        from minisgl.engine.factory import create_engine, shutdown_engine  # torch: here only

        # The weight loader's progress bar would create a multiprocessing lock, which the
        # resource tracker then reports as leaked when this worker leaves via os._exit.
        tqdm.set_lock(threading.RLock())
        engine = create_engine(args)  # with tp_size > 1, rank 0 of the group
        from minisgl.kvcache.kv_pool import kv_cache_name
        from minisgl.quant.loading import weights_info

        # The weights' format and bytes, for /metrics' model info (rank 0's, under TP).
        local = getattr(engine, "engine", engine)  # a TPEngine's own rank-0 Engine
        model_info = weights_info(
            local.runner.model, local.model_config, args.quantization, args.lm_head_quantization
        )
        model_info["dtype"] = str(local.runner.dtype).removeprefix("torch.")
        model_info["kv_cache"] = kv_cache_name(local.runner.kv_pool.cache_dtype)
        inbox: PullQueue[Any] = PullQueue(ctx, endpoints.scheduler, tokenizer_to_scheduler.KINDS)
        to_detok: PushQueue[Any] = PushQueue(
            ctx, endpoints.detokenizer, scheduler_to_detokenizer.KINDS
        )
        freeze_startup_objects()
    except BaseException as exc:
        report_failure(ready, exc)
        raise
    life.serving()
    log.info(
        "model loaded in %s (pid %d): %s, context %d, %d KV pages",
        elapsed(start),
        os.getpid(),
        engine.model_path,
        engine.max_seq_len,
        engine.stats().num_pages_total,
    )
    report_ready(
        ready,
        pid=os.getpid(),
        max_seq_len=engine.max_seq_len,
        vocab_size=engine.vocab_size,
        model_path=str(engine.model_path),
        **model_info,
    )
    try:
        SchedulerLoop(engine, inbox, to_detok, log).run(life)
    finally:
        shutdown_engine(engine)  # tensor-parallel followers leave with rank 0
    inbox.close()
    to_detok.close()
    exit_now()
