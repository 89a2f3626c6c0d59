"""Tokenizer worker: text or chat messages -> token ids, off the API server's event loop.

Tokenizing a long prompt or rendering a chat template is CPU work measured in milliseconds;
done in the API process it would stall every open stream. Here it runs in its own process,
in arrival order, so an abort always reaches the scheduler after the request it cancels.
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
from minisgl.tokenizer.without_torch import keep_torch_out


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer  # heavy import: only in the worker

    return AutoTokenizer.from_pretrained(model)


def render_chat(
    tokenizer: Any,
    messages: Any,
    template_kwargs: Any,
    tools: Any,
    add_generation_prompt: bool,
) -> str:
    """Chat messages (and tools) through the model's own template. Raises ValueError with a
    user-facing message: jinja errors and bad kwargs are the request's fault."""
    kwargs = dict(template_kwargs)
    if tools:
        kwargs["tools"] = tools
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        )
    except Exception as exc:
        raise ValueError(f"cannot apply the chat template: {exc}") from exc


def tokenize(tokenizer: Any, req: TokenizeRequest) -> list[int]:
    """Token ids of the request's prompt. Raises ValueError with a user-facing message."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.messages is not None:
        text = render_chat(tokenizer, req.messages, req.chat_template_kwargs, req.tools, True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(req.prompt_text or "", add_special_tokens=False))


def tokenize_only(tokenizer: Any, req: TokenizeOnly) -> TokenizerReply:
    """POST /tokenize: the ids of a prompt, or of chat messages through the template."""
    if req.messages is not None:
        text = render_chat(
            tokenizer, req.messages, req.chat_template_kwargs, req.tools, req.add_generation_prompt
        )
    else:
        text = req.prompt or ""
    ids = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizerReply(req.rid, tokens=ids, token_strs=strs)


def _text_tool(
    tokenizer: Any, msg: TokenizeOnly | DetokenizeOnly, log: logging.Logger
) -> TokenizerReply | ErrorReply:
    try:
        if isinstance(msg, TokenizeOnly):
            return tokenize_only(tokenizer, msg)
        return TokenizerReply(msg.rid, text=tokenizer.decode(msg.tokens))
    except Exception as exc:  # the request's fault (bad template kwargs, odd ids)
        log.info("rid=%s rejected: %s", msg.rid, exc)
        param = "tokens" if isinstance(msg, DetokenizeOnly) else None
        return ErrorReply(msg.rid, str(exc), 400, param)


def run_tokenizer_worker(
    model: str, endpoints: Endpoints, ready: Connection, log_level: str
) -> None:
    keep_torch_out()
    log = setup_logging(log_level, "tokenizer")
    life = WorkerLife()
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(model)
        ctx = zmq.Context()
        inbox: PullQueue[Any] = PullQueue(ctx, endpoints.tokenizer, api_to_tokenizer.KINDS)
        to_scheduler: PushQueue[Any] = PushQueue(
            ctx, endpoints.scheduler, tokenizer_to_scheduler.KINDS
        )
        to_api: PushQueue[Any] = PushQueue(ctx, endpoints.api, detokenizer_to_api.KINDS)
    except BaseException as exc:
        report_failure(ready, exc)
        raise
    life.serving()
    log.info("tokenizer loaded in %s (pid %d)", elapsed(start), os.getpid())
    report_ready(ready, pid=os.getpid())
    while life.alive():
        for msg in inbox.get_all(timeout=0.1):
            _handle(msg, tokenizer, to_scheduler, to_api, log)
    inbox.close()
    to_scheduler.close()
    to_api.close()
    exit_now()


def _handle(
    msg: Any, tokenizer: Any, to_scheduler: PushQueue, to_api: PushQueue, log: logging.Logger
) -> None:
    if isinstance(msg, TokenizeRequest):
        try:
            ids = tokenize(tokenizer, msg)
        except ValueError as exc:
            log.info("rid=%s rejected: %s", msg.rid, exc)
            to_api.put(ErrorReply(msg.rid, str(exc), 400, "messages"))
            return
        except Exception as exc:  # never let one request kill the worker
            log.exception("rid=%s tokenization failed", msg.rid)
            to_api.put(ErrorReply(msg.rid, f"tokenization failed: {exc}", 400, None))
            return
        log.debug("rid=%s tokenized: %d prompt tokens", msg.rid, len(ids))
        timeline.mark(msg.rid, "tokenized")
        to_scheduler.put(
            TokenizedRequest(
                msg.rid,
                ids,
                msg.params,
                msg.max_tokens,
                msg.arrival_time,
                msg.skip_special_tokens,
                msg.echo,
                msg.keep_special,
            )
        )
    elif isinstance(msg, TokenizeOnly | DetokenizeOnly):
        to_api.put(_text_tool(tokenizer, msg, log))
    elif isinstance(msg, AbortRequest):
        to_scheduler.put(msg)
    elif isinstance(msg, Ping):
        msg.hops.append("tokenizer")
        to_scheduler.put(msg)
