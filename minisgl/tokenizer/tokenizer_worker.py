"""Tokenizer worker: text or chat messages -> token ids, off the API server's event loop.

Tokenizing a long prompt or rendering a chat template is CPU work measured in milliseconds;
done in the API process it would stall every open stream. Here it runs in its own process,
in arrival order, so an abort always reaches the scheduler after the request it cancels. A
template a request brings renders in a sandbox process under a time bound (template_sandbox);
meanwhile this loop goes on serving, and answers the API server's heartbeats.
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl import timeline
from minisgl.message import api_to_tokenizer, detokenizer_to_api, tokenizer_to_scheduler
from minisgl.message.api_to_tokenizer import (
    AbortRequest,
    DetokenizeOnly,
    Heartbeat,
    Ping,
    TokenizeOnly,
    TokenizeRequest,
)
from minisgl.message.detokenizer_to_api import ErrorReply, TokenizerReply
from minisgl.message.endpoints import Endpoints
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
from minisgl.process import (
    WorkerLife,
    elapsed,
    exit_now,
    report_failure,
    report_ready,
    setup_logging,
)
from minisgl.structured.template_kwargs import request_template
from minisgl.tokenizer.chat_render import load_tokenizer, prefilled_think, render_chat
from minisgl.tokenizer.template_sandbox import RenderError, RenderJob, TemplateSandbox
from minisgl.tokenizer.without_torch import keep_torch_out


def tokenize(tokenizer: Any, req: TokenizeRequest, text: str | None = None) -> list[int]:
    """Token ids of the request's prompt (`text`: its chat messages, rendered already).
    Raises ValueError with a user-facing message."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.messages is not None:
        if text is None:
            text = render_chat(
                tokenizer,
                req.messages,
                req.chat_template_kwargs,
                req.tools,
                req.add_generation_prompt,
            )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(req.prompt_text or "", add_special_tokens=False))


def tokenize_only(tokenizer: Any, req: TokenizeOnly, text: str | None = None) -> TokenizerReply:
    """POST /tokenize: the ids of a prompt, or of chat messages through the template."""
    if req.messages is not None and text is None:
        text = render_chat(
            tokenizer, req.messages, req.chat_template_kwargs, req.tools, req.add_generation_prompt
        )
    elif req.messages is None:
        text = req.prompt or ""
    ids = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizerReply(req.rid, tokens=ids, token_strs=strs)


def _text_tool(
    tokenizer: Any, msg: TokenizeOnly | DetokenizeOnly, log: logging.Logger, text: str | None = None
) -> TokenizerReply | ErrorReply:
    try:
        if isinstance(msg, TokenizeOnly):
            return tokenize_only(tokenizer, msg, text)
        return TokenizerReply(msg.rid, text=tokenizer.decode(msg.tokens))
    except Exception as exc:  # the request's fault (bad template kwargs, odd ids)
        log.info("rid=%s rejected: %s", msg.rid, exc)
        param = "tokens" if isinstance(msg, DetokenizeOnly) else None
        return ErrorReply(msg.rid, str(exc), 400, param)


def run_tokenizer_worker(
    model: str,
    endpoints: Endpoints,
    template_timeout: float | None,
    ready: Connection,
    log_level: str,
) -> None:
    """`template_timeout`: the render bound of request-supplied chat templates (None: the
    server does not take them, so no sandbox process is started)."""
    keep_torch_out()
    log = setup_logging(log_level, "tokenizer")
    life = WorkerLife(endpoints.root)
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(model)
        ctx = zmq.Context()
        inbox: PullQueue[Any] = PullQueue(ctx, endpoints.tokenizer, api_to_tokenizer.KINDS)
        to_scheduler: PushQueue[Any] = PushQueue(
            ctx, endpoints.scheduler, tokenizer_to_scheduler.KINDS
        )
        to_api: PushQueue[Any] = PushQueue(ctx, endpoints.api, detokenizer_to_api.KINDS)
        sandbox = None if template_timeout is None else TemplateSandbox(model, template_timeout)
        thinking = prefilled_think(tokenizer)
    except BaseException as exc:
        report_failure(ready, exc)
        raise
    life.serving()
    log.info("tokenizer loaded in %s (pid %d)", elapsed(start), os.getpid())
    report_ready(ready, pid=os.getpid(), prefilled_think=thinking)
    worker = TokenizerLoop(tokenizer, to_scheduler, to_api, sandbox, log)
    while life.alive():
        # A render in the sandbox is checked on often; otherwise the inbox wakes the loop.
        msgs = inbox.get_all(timeout=0.005 if worker.rendering else 0.1)
        for i, msg in enumerate(msgs):
            worker.queued_behind = len(msgs) - 1 - i  # requests of a burst right behind this
            worker.handle(msg)
        worker.collect_renders()
    if sandbox is not None:
        sandbox.close()
    inbox.close()
    to_scheduler.close()
    to_api.close()
    exit_now()


class TokenizerLoop:
    """Handles the API server's messages in arrival order. A chat whose template came with the
    request goes to the sandbox and finishes when `collect_renders` finds its text; the rest
    (the model's own template, plain prompts) is done on the spot."""

    def __init__(
        self,
        tokenizer: Any,
        to_scheduler: PushQueue,
        to_api: PushQueue,
        sandbox: TemplateSandbox | None,
        log: logging.Logger,
    ) -> None:
        self.tokenizer = tokenizer
        self.to_scheduler = to_scheduler
        self.to_api = to_api
        self.sandbox = sandbox
        self.log = log
        self.rendering: dict[str, TokenizeRequest | TokenizeOnly] = {}  # rid -> its message
        self.queued_behind = 0  # messages received with the one in hand, not handled yet

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizeRequest | TokenizeOnly) and self._to_sandbox(msg):
            return
        if isinstance(msg, TokenizeRequest):
            self._tokenized(msg, None)
        elif isinstance(msg, TokenizeOnly | DetokenizeOnly):
            self.to_api.put(_text_tool(self.tokenizer, msg, self.log))
        elif isinstance(msg, AbortRequest):
            if msg.index is None and self.rendering.pop(msg.rid, None) is not None:
                assert self.sandbox is not None
                self.sandbox.cancel(msg.rid)  # the scheduler never heard of it
                self.log.info("rid=%s aborted while its template rendered", msg.rid)
                return
            self.to_scheduler.put(msg)
        elif isinstance(msg, Ping):
            msg.hops.append("tokenizer")
            self.to_scheduler.put(msg)
        elif isinstance(msg, Heartbeat):
            self.to_api.put(msg)  # straight back: /health learns this loop still turns

    def collect_renders(self) -> None:
        if self.sandbox is None or not self.rendering:
            return
        for rid, result in self.sandbox.poll():
            msg = self.rendering.pop(rid, None)
            if msg is None:
                continue
            if isinstance(result, RenderError):
                self.log.info("rid=%s rejected: %s", rid, result)
                self.to_api.put(ErrorReply(rid, str(result), 400, "chat_template_kwargs"))
            elif isinstance(msg, TokenizeRequest):
                self._tokenized(msg, result)
            else:
                self.to_api.put(_text_tool(self.tokenizer, msg, self.log, result))

    def _to_sandbox(self, msg: TokenizeRequest | TokenizeOnly) -> bool:
        template = request_template(msg.chat_template_kwargs) if msg.messages else None
        if template is None:
            return False
        if self.sandbox is None:  # the API server refuses these; never render one here
            self.to_api.put(
                ErrorReply(msg.rid, "request chat templates are off", 400, "chat_template_kwargs")
            )
            return True
        job = RenderJob(
            msg.rid, msg.messages, msg.chat_template_kwargs, msg.tools, msg.add_generation_prompt
        )
        self.sandbox.submit(job)
        self.rendering[msg.rid] = msg
        return True

    def _tokenized(self, msg: TokenizeRequest, text: str | None) -> None:
        try:
            ids = tokenize(self.tokenizer, msg, text)
        except ValueError as exc:
            self.log.info("rid=%s rejected: %s", msg.rid, exc)
            self.to_api.put(ErrorReply(msg.rid, str(exc), 400, "messages"))
            return
        except Exception as exc:  # never let one request kill the worker
            self.log.exception("rid=%s tokenization failed", msg.rid)
            self.to_api.put(ErrorReply(msg.rid, f"tokenization failed: {exc}", 400, None))
            return
        self.log.debug("rid=%s tokenized: %d prompt tokens", msg.rid, len(ids))
        timeline.mark(msg.rid, "tokenized")
        self.to_scheduler.put(
            TokenizedRequest(
                msg.rid,
                ids,
                msg.params,
                msg.max_tokens,
                msg.arrival_time,
                msg.skip_special_tokens,
                msg.echo,
                msg.keep_special,
                more=msg.more or self.queued_behind > 0,
            )
        )
