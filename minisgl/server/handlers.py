"""Drives one completion request through the pipeline and formats the reply (stream or not)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl import timeline
from minisgl.message.api_to_tokenizer import TokenizeRequest
from minisgl.message.detokenizer_to_api import ErrorReply, TextOutput
from minisgl.sampling_params import SamplingParams
from minisgl.server.arrivals import more_behind
from minisgl.server.chat_output import ChatOutput
from minisgl.server.choices import Choices
from minisgl.server.context import ServerContext
from minisgl.server.errors import APIError, error_response
from minisgl.server.manager import RequestState
from minisgl.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    ResponseMessage,
    ResponseToolCall,
    SamplingFields,
    Usage,
)
from minisgl.server.structured_request import grammar_field

log = logging.getLogger("minisgl.api")


def sampling_params(
    ctx: ServerContext,
    req: SamplingFields,
    limit: int | None,
    grammar: tuple[str, str] | None = None,
) -> SamplingParams:
    bad = req.unsupported()
    if bad is not None:
        raise APIError(400, bad[1], bad[0])
    vocab = ctx.vocab_size
    if vocab is not None and any(t >= vocab for t in req.stop_token_ids or []):
        raise APIError(
            400, f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids"
        )
    if req.n > ctx.args.max_n:
        raise APIError(
            400, f"n must be at most {ctx.args.max_n} on this server (--max-n), got {req.n}", "n"
        )
    least = req.least_tokens()
    if limit is not None and least > limit:
        name = "min_tokens" if req.min_tokens is not None else "min_new_tokens"
        raise APIError(400, f"{name} ({least}) must be at most {req.limit_text()}", name)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    if vocab is not None and any(t >= vocab for t in bias):
        raise APIError(
            400, f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias"
        )
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            # The scheduler fills the context when limit is None (and checks min_tokens then).
            max_tokens=limit if limit is not None else max(1, least),
            min_tokens=least,
            ignore_eos=req.ignore_eos,
            stop=req.stop or [],  # type: ignore[arg-type]
            stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output,
            grammar_kind=grammar[0] if grammar else None,
            grammar=grammar[1] if grammar else None,
            n=req.n,
            logprobs=req.num_logprobs(),
            prompt_logprobs=req.num_prompt_logprobs(),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=bias,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def admit(ctx: ServerContext, seqs: int = 1, param: str | None = None) -> None:
    """Admission of a request for `seqs` sequences (prompts x n), as a whole: all of them
    queue, or none. `param`: the field that sets their number."""
    if ctx.draining or ctx.dead_worker:
        raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
    if not ctx.ready:
        raise APIError(503, "the server is starting", headers={"Retry-After": "1"})
    limit = ctx.args.max_queued_requests
    if seqs > limit:  # would never fit: retrying cannot help
        raise APIError(
            400,
            f"the request asks for {seqs} sequences (prompts x n); this server queues at most "
            f"{limit} (--max-queued-requests)",
            param,
        )
    if ctx.manager.num_waiting + seqs > limit:
        raise APIError(
            503,
            f"too many waiting sequences (limit {limit}); retry later",
            headers={"Retry-After": "1"},
        )


@dataclass
class Tracker:
    """Timing points and text of one request at the API server (for metrics and usage)."""

    rid: str
    arrival: float
    stream: bool
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    queue_time: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False
    first_byte: bool = False  # the first content chunk went out (timeline)
    sample_tokens: dict[int, int] = field(default_factory=dict)  # per sample (n > 1)
    # In a list of prompts, a prompt's n samples run as engine requests of their own; the
    # metrics count the prompt as one request (as a single prompt with n samples is), through
    # the group of its samples' trackers.
    group: SampleGroup | None = None

    def on_output(self, out: TextOutput) -> None:
        if out.queue_time is not None and self.queue_time is None:
            self.queue_time = out.queue_time
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        if out.index == 0:
            # Sample 0 prefills the prompt; the other samples reuse its pages, which are no
            # hits of an earlier request's prefix (OpenAI and vLLM count the prompt once).
            self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.sample_tokens[out.index] = out.completion_tokens
        self.completion_tokens = sum(self.sample_tokens.values())
        if out.text:
            now = time.time()
            if self.first_token_time is None:
                self.first_token_time = now
            self.token_times.append(now)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def refuse(self, ctx: ServerContext | None = None) -> None:
        """The request was refused (a 4xx: bad input the engine found, e.g. an invalid
        grammar or too long a context) or dropped with a sibling that was: it never ran, so
        it counts in no request metric, as the API server's own 400s do not."""
        if not self.done:
            self.done = True
            log.info("rid=%s refused", self.rid)
            if self.group is not None and ctx is not None:
                self.group.member_done(ctx, time.time())

    def fail(self, ctx: ServerContext, reply: ErrorReply) -> None:
        """End the request with an error reply: refused (4xx) or failed (5xx: `error`)."""
        if reply.status < 500:
            self.refuse(ctx)
        else:
            self.finish(ctx, "error")

    def finish(self, ctx: ServerContext, reason: str) -> None:
        if self.done:
            return
        self.done = True
        now = time.time()
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else None
        log.info(
            "rid=%s %s: reason=%s prompt=%d completion=%d cached=%d ttft=%s e2e=%.3fs",
            self.rid,
            "aborted" if reason == "abort" else "finished",
            reason,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            f"{ttft:.3f}s" if ttft is not None else "-",
            now - self.arrival,
        )
        self.finish_reason = reason
        if self.group is not None:
            self.group.member_done(ctx, now)
            return
        record_finished(ctx, [self], reason, now)


def record_finished(ctx: ServerContext, trackers: list[Tracker], reason: str, now: float) -> None:
    """One finished request in the metrics: a prompt and all its samples (the first tracker
    holds the prompt, as usage counts it: once)."""
    first = trackers[0]
    firsts = [t.first_token_time for t in trackers if t.first_token_time is not None]
    try:
        ctx.metrics.request_finished(
            finish_reason=reason,
            prompt_tokens=first.prompt_tokens,
            generation_tokens=sum(t.completion_tokens for t in trackers),
            cached_tokens=first.cached_tokens,
            arrival_time=first.arrival,
            first_token_time=min(firsts) if firsts else None,
            finish_time=now,
            queue_time=first.queue_time,
            token_times=sorted(x for t in trackers for x in t.token_times),
        )
    except Exception:
        log.exception("rid=%s metrics failed", first.rid)


@dataclass
class SampleGroup:
    """The n samples of one prompt in a list of prompts (each its own engine request): one
    request in the metrics once all are done, as a single prompt with n samples counts. Its
    finish reason: error if a sample failed, else sample 0's (as a single prompt's). Samples
    refused (a 4xx) count nowhere; a group with none finished counts nowhere."""

    members: list[Tracker] = field(default_factory=list)

    def member_done(self, ctx: ServerContext, now: float) -> None:
        if not all(t.done for t in self.members):
            return
        ran = [t for t in self.members if t.finish_reason is not None]
        if not ran:
            return
        reasons = [t.finish_reason for t in ran]
        reason = "error" if "error" in reasons else str(ran[0].finish_reason)
        record_finished(ctx, ran, reason, now)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def next_reply(state: RequestState, watcher: asyncio.Task[None]) -> Any:
    """The request's next reply, or None when the client disconnected first."""
    getter = asyncio.ensure_future(state.queue.get())
    await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


Formatter = Callable[[str, str | None], dict[str, Any]]


async def serve_request(
    ctx: ServerContext,
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    tok_req_fields: dict[str, Any],
    kind: str,
    arrival: float,
    grammar: tuple[str, str] | None = None,
    output: ChatOutput | None = None,
) -> Response:
    params = sampling_params(ctx, req, req.limit(), grammar)
    output = output if output is not None and output.active else None
    admit(ctx, req.n, "n")
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    tracker = Tracker(rid, arrival, req.stream)
    echo = isinstance(req, CompletionRequest) and req.echo
    prompt_text = tok_req_fields.get("prompt_text")
    choices = Choices(kind, req.n, req.num_logprobs() is not None, echo, prompt_text)
    # Each choice parses its own text: tool-call and reasoning parsers keep per-stream state.
    outputs = [output.fresh() for _ in range(req.n)] if output is not None else None
    tok_req = TokenizeRequest(
        rid=rid,
        arrival_time=arrival,
        params=params,
        max_tokens=req.limit(),
        skip_special_tokens=req.skip_special_tokens,
        echo=echo and prompt_text is None,  # an ids prompt: the detokenizer decodes it
        **tok_req_fields,
    )
    log.info("rid=%s received: %s stream=%s n=%d", rid, kind, req.stream, req.n)
    timeline.mark(rid, "received")
    counted = getattr(request.state, "arrival_count", None)
    tok_req.more = await more_behind(ctx.arrivals, counted, not ctx.manager.requests)
    try:
        state = ctx.manager.submit(tok_req, grammar_field(req) if grammar else None)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a 2**70 in chat_template_kwargs
        log.info("rid=%s rejected: cannot encode: %s", rid, exc)
        raise APIError(400, "the request holds values that cannot be processed") from None
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        first = await next_reply(state, watcher)
    except BaseException:
        watcher.cancel()
        ctx.manager.abort(rid)
        tracker.finish(ctx, "abort")
        raise
    if first is None:
        log.info("rid=%s client disconnected while waiting", rid)
        ctx.manager.abort(rid)
        tracker.finish(ctx, "abort")
        return Response(status_code=499)
    if isinstance(first, ErrorReply):
        watcher.cancel()
        ctx.manager.release(rid)
        tracker.fail(ctx, first)
        return error_response(first.status, first.message, first.param)
    if req.stream:
        watcher.cancel()  # from here Starlette cancels the stream when the client goes
        return StreamingResponse(
            _stream(ctx, state, tracker, first, kind, req, choices, outputs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return await _collect(ctx, state, tracker, first, kind, watcher, choices, outputs)
    finally:
        watcher.cancel()


async def _collect(
    ctx: ServerContext,
    state: RequestState,
    tracker: Tracker,
    reply: Any,
    kind: str,
    watcher: asyncio.Task[None],
    choices: Choices,
    outputs: list[ChatOutput] | None,
) -> Response:
    try:
        while True:
            if reply is None:
                log.info("rid=%s client disconnected", tracker.rid)
                ctx.manager.abort(tracker.rid)
                tracker.finish(ctx, "abort")
                return Response(status_code=499)
            if isinstance(reply, ErrorReply):
                ctx.manager.release(tracker.rid)
                tracker.fail(ctx, reply)
                return error_response(reply.status, reply.message, reply.param)
            tracker.on_output(reply)
            choices.add(reply)
            if choices.all_done:
                break
            reply = await next_reply(state, watcher)
    except BaseException:
        ctx.manager.abort(tracker.rid)
        tracker.finish(ctx, "abort")
        raise
    ctx.manager.release(tracker.rid)
    tracker.finish(ctx, choices.choices[0].finish_reason or "stop")
    usage = Usage(
        prompt_tokens=tracker.prompt_tokens,
        completion_tokens=tracker.completion_tokens,
        total_tokens=tracker.prompt_tokens + tracker.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=tracker.cached_tokens),
    )
    created = int(tracker.arrival)
    body: ChatCompletionResponse | CompletionResponse
    if kind == "chat":
        body = ChatCompletionResponse(
            id=tracker.rid,
            created=created,
            model=ctx.model_name,
            choices=[_chat_choice(c, outputs) for c in choices.body_choices()],
            usage=usage,
        )
    else:
        body = CompletionResponse(
            id=tracker.rid,
            created=created,
            model=ctx.model_name,
            choices=[CompletionChoice(**c) for c in choices.body_choices()],
            usage=usage,
        )
    response = JSONResponse(body.model_dump())
    timeline.mark(tracker.rid, "replied")
    return response


def _chat_choice(entry: dict[str, Any], outputs: list[ChatOutput] | None) -> ChatChoice:
    """One choice of a chat response: its text parsed into reasoning/content/tool calls."""
    if outputs is None:
        return ChatChoice(**entry)
    output = outputs[entry["index"]]
    cut = entry["finish_reason"] == "length"
    content, reasoning, calls = output.whole(entry["message"]["content"], cut=cut)
    message = ResponseMessage(
        content=content,
        reasoning_content=reasoning,
        tool_calls=[ResponseToolCall.model_validate(c.to_openai()) for c in calls],
    )
    reason = _finish_reason(entry["finish_reason"] or "stop", bool(calls))
    return ChatChoice(
        index=entry["index"], message=message, finish_reason=reason, logprobs=entry["logprobs"]
    )


def _finish_reason(reason: str, called: bool) -> str:
    """A reply that ends in tool calls finishes with "tool_calls" (a cut-off stays "length")."""
    return "tool_calls" if called and reason == "stop" else reason


def sse_event(obj: Any) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(
    ctx: ServerContext,
    state: RequestState,
    tracker: Tracker,
    reply: Any,
    kind: str,
    req: SamplingFields,
    choices: Choices,
    outputs: list[ChatOutput] | None,
) -> AsyncIterator[str]:
    """OpenAI SSE: role first (chat), then content deltas, each choice's finish_reason after
    its last delta, then the usage chunk (when asked) and [DONE]."""
    include_usage = req.include_usage
    continuous = include_usage and bool(
        req.stream_options and req.stream_options.continuous_usage_stats
    )
    created = int(tracker.arrival)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(
        index: int, delta: dict[str, Any] | str, reason: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        if kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "finish_reason": reason}
        choice["logprobs"] = logprobs
        out: dict[str, Any] = {
            "id": tracker.rid,
            "object": obj,
            "created": created,
            "model": ctx.model_name,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = tracker.usage() if continuous else None
        return out

    def deltas(index: int, text: str, final: bool, cut: bool = False) -> list[dict[str, Any] | str]:
        if kind != "chat":
            return [text] if text else []
        if outputs is None:
            return [{"content": text}] if text else []
        output = outputs[index]
        return list(output.finish(cut=cut) if final else output.feed(text))

    try:
        if kind == "chat":
            for c in choices.choices:
                yield sse_event(chunk(c.index, {"role": "assistant", "content": ""}, None))
        while True:
            if isinstance(reply, ErrorReply):
                # A worker failed mid-stream: the status is sent already, so say it in-band.
                ctx.manager.release(tracker.rid)
                tracker.finish(ctx, "error")
                yield sse_event(
                    {
                        "error": {
                            "message": reply.message,
                            "type": "server_error",
                            "param": None,
                            "code": reply.status,
                        }
                    }
                )
                return
            tracker.on_output(reply)
            text, logprobs = choices.add(reply)
            pieces = deltas(reply.index, text, False)
            if not pieces and logprobs is not None:
                pieces = [{} if kind == "chat" else ""]  # logprobs of tokens with no text yet
            for i, delta in enumerate(pieces):
                yield sse_event(chunk(reply.index, delta, None, logprobs if i == 0 else None))
                if timeline.enabled():
                    timeline.mark(tracker.rid, "token" if tracker.first_byte else "first_byte")
                    tracker.first_byte = True
            if reply.finished:
                reason = choices.choices[reply.index].finish_reason or "stop"
                for delta in deltas(reply.index, "", True, cut=reason == "length"):
                    yield sse_event(chunk(reply.index, delta, None))
                if outputs is not None:
                    reason = _finish_reason(reason, bool(outputs[reply.index].calls))
                yield sse_event(chunk(reply.index, {} if kind == "chat" else "", reason))
            if choices.all_done:
                break
            reply = await state.queue.get()
        ctx.manager.release(tracker.rid)
        tracker.finish(ctx, choices.choices[0].finish_reason or "stop")
        if include_usage:
            yield sse_event(
                {
                    "id": tracker.rid,
                    "object": obj,
                    "created": created,
                    "model": ctx.model_name,
                    "choices": [],
                    "usage": tracker.usage(),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        if not tracker.done:  # cancelled: the client went away mid-stream
            log.info("rid=%s client disconnected mid-stream", tracker.rid)
            ctx.manager.abort(tracker.rid)
            tracker.finish(ctx, "abort")
