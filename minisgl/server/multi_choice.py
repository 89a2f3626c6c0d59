"""/v1/completions with a list of prompts: one engine request per choice, answered together.

Choice `index` = prompt_index * n + sample (OpenAI's and vLLM's numbering), so samples per
prompt plug in as more choices. Each choice is its own request through the pipeline (its own
rid, tracker and metrics); the reply merges them: one response, or one SSE stream whose chunks
carry their choice's index. usage counts each prompt once (as OpenAI and vLLM do): its prompt
and cached tokens are those of its sample 0, which is queued first, so a cache hit never
counts a sibling sample's prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.message.api_to_tokenizer import TokenizeRequest
from minisgl.message.detokenizer_to_api import ErrorReply, TextOutput
from minisgl.sampling_params import SamplingParams
from minisgl.server.choices import Choices
from minisgl.server.context import ServerContext
from minisgl.server.errors import APIError, error_response
from minisgl.server.handlers import SampleGroup, Tracker, admit, sampling_params, sse_event
from minisgl.server.manager import RequestState
from minisgl.server.protocol import CompletionRequest
from minisgl.server.structured_request import grammar_field

log = logging.getLogger("minisgl.api")


@dataclass
class Choice:
    index: int
    sample: int  # which sample of its prompt
    tracker: Tracker
    state: RequestState
    out: Choices  # its text, echo and logprobs (one sample: the engine sees n=1)
    finish_reason: str | None = None


async def serve_prompts(
    ctx: ServerContext,
    request: Request,
    req: CompletionRequest,
    prompts: list[dict[str, Any]],
    arrival: float,
    grammar: tuple[str, str] | None,
) -> Response:
    """`prompts`: the TokenizeRequest fields of each prompt (prompt_text or prompt_ids)."""
    base = "cmpl-" + uuid.uuid4().hex[:24]
    samples = req.n
    params = sampling_params(ctx, req, req.limit(), grammar)
    admit(ctx, len(prompts) * samples, "prompt")
    want_logprobs = req.num_logprobs() is not None
    choices: list[Choice] = []
    try:
        for p_index, fields in enumerate(prompts):
            prompt_text = fields.get("prompt_text")
            group = SampleGroup()  # the prompt: one request in the metrics, whatever n
            for sample in range(samples):
                index = p_index * samples + sample
                rid = f"{base}-{index}"
                tok_req = TokenizeRequest(
                    rid=rid,
                    arrival_time=arrival,
                    params=_one_sample(params, sample),
                    max_tokens=req.limit(),
                    skip_special_tokens=req.skip_special_tokens,
                    echo=req.echo and prompt_text is None,  # the detokenizer decodes ids
                    # Another sequence of this request follows it (a burst of its own).
                    more=p_index < len(prompts) - 1 or sample < samples - 1,
                    **fields,
                )
                state = ctx.manager.submit(tok_req, grammar_field(req) if grammar else None)
                out = Choices("completion", 1, want_logprobs, req.echo, prompt_text)
                tracker = Tracker(rid, arrival, req.stream, group=group)
                group.members.append(tracker)
                choices.append(Choice(index, sample, tracker, state, out))
    except (TypeError, ValueError, OverflowError):
        _abort_all(ctx, choices)
        raise APIError(400, "the request holds values that cannot be processed") from None
    except BaseException:
        _abort_all(ctx, choices)
        raise
    counted = getattr(request.state, "arrival_count", None)
    if counted is not None:
        counted.leave()  # handed on
    log.info("rid=%s received: completion of %d prompts stream=%s", base, len(prompts), req.stream)
    if req.stream:
        # A stream's status goes out with its first byte: every prompt and sample must have
        # passed the engine's checks (context, grammar) first, so bad input is a 400.
        refused = await _settle(ctx, request, base, choices)
        if refused is not None:
            return refused
    merged: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(c, merged)) for c in choices]
    if req.stream:
        return StreamingResponse(
            _stream(ctx, base, req, choices, merged, pumps),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect(ctx, request, base, choices, merged, pumps)


def _one_sample(params: SamplingParams, sample: int) -> SamplingParams:
    """Sample `sample` of a prompt as its own engine request: seed + sample (as n > 1 does),
    and it scores its own prompt (no sibling in the engine shares it)."""
    one = params.sample_params(sample)
    return dataclasses.replace(one, prompt_logprobs=params.prompt_logprobs)


async def _pump(choice: Choice, merged: asyncio.Queue[tuple[Choice, Any]]) -> None:
    while True:
        reply = await choice.state.queue.get()
        await merged.put((choice, reply))
        if not isinstance(reply, TextOutput) or reply.finished:
            return


def _abort_all(ctx: ServerContext, choices: list[Choice], refused: bool = False) -> None:
    """Drop the choices still in flight: aborted (the client went, or a sibling failed), or,
    with `refused`, not counted at all (a sibling was refused with a 4xx: none of it ran)."""
    for c in choices:
        if not c.tracker.done:
            ctx.manager.abort(c.tracker.rid)
            if refused:
                c.tracker.refuse(ctx)
            else:
                c.tracker.finish(ctx, "abort")


def _fail(ctx: ServerContext, choice: Choice, reply: ErrorReply, choices: list[Choice]) -> None:
    """End the request on one choice's error reply (refused, or failed), dropping the rest."""
    ctx.manager.release(choice.tracker.rid)
    choice.tracker.fail(ctx, reply)
    _abort_all(ctx, choices, refused=reply.status < 500)


def _usage(choices: list[Choice]) -> dict[str, Any]:
    firsts = [c for c in choices if c.sample == 0]  # one per prompt
    prompt = sum(c.tracker.prompt_tokens for c in firsts)
    completion = sum(c.tracker.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.tracker.cached_tokens for c in firsts)},
    }


def _on_reply(ctx: ServerContext, choice: Choice, reply: Any) -> tuple[bool, str, Any]:
    """Account one reply: (finished, the text and logprobs a stream chunk carries now)."""
    choice.tracker.on_output(reply)
    text, logprobs = choice.out.add(reply)
    if not reply.finished:
        return False, text, logprobs
    ctx.manager.release(choice.tracker.rid)
    choice.finish_reason = reply.finish_reason or "stop"
    choice.tracker.finish(ctx, choice.finish_reason)
    return True, text, logprobs


async def _settle(
    ctx: ServerContext, request: Request, base: str, choices: list[Choice]
) -> Response | None:
    """Wait until every choice was accepted by the engine or failed (each does, one way or
    the other): None when all were accepted, else the response that ends the request, all of
    it dropped."""
    watcher = asyncio.ensure_future(_disconnected(request))
    settled: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(c.state.settled.wait() for c in choices))
    )
    try:
        await asyncio.wait([settled, watcher], return_when=asyncio.FIRST_COMPLETED)
        accepted = settled.done()
    except BaseException:
        _abort_all(ctx, choices)
        raise
    finally:
        watcher.cancel()
        settled.cancel()
    if not accepted:
        log.info("rid=%s client disconnected while waiting", base)
        _abort_all(ctx, choices)
        return Response(status_code=499)
    failed = next((c for c in choices if c.state.error is not None), None)
    if failed is None:
        return None
    error = failed.state.error
    assert error is not None
    log.info("rid=%s rejected: choice %d: %s", base, failed.index, error.message)
    _fail(ctx, failed, error, choices)
    return error_response(error.status, error.message, error.param)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    ctx: ServerContext,
    request: Request,
    base: str,
    choices: list[Choice],
    merged: asyncio.Queue[tuple[Choice, Any]],
    pumps: list[asyncio.Task[None]],
) -> Response:
    watcher = asyncio.ensure_future(_disconnected(request))
    left = len(choices)
    try:
        while left:
            getter = asyncio.ensure_future(merged.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                log.info("rid=%s client disconnected", base)
                _abort_all(ctx, choices)
                return Response(status_code=499)
            choice, reply = getter.result()
            if isinstance(reply, ErrorReply):
                _fail(ctx, choice, reply, choices)
                return error_response(reply.status, reply.message, reply.param)
            left -= _on_reply(ctx, choice, reply)[0]
    except BaseException:
        _abort_all(ctx, choices)
        raise
    finally:
        watcher.cancel()
        for p in pumps:
            p.cancel()
    body = {
        "id": base,
        "object": "text_completion",
        "created": int(choices[0].tracker.arrival),
        "model": ctx.model_name,
        "choices": [{**c.out.body_choices()[0], "index": c.index} for c in choices],
        "usage": _usage(choices),
    }
    return JSONResponse(body)


async def _stream(
    ctx: ServerContext,
    base: str,
    req: CompletionRequest,
    choices: list[Choice],
    merged: asyncio.Queue[tuple[Choice, Any]],
    pumps: list[asyncio.Task[None]],
) -> AsyncIterator[str]:
    created = int(choices[0].tracker.arrival)
    include_usage = req.include_usage
    continuous = include_usage and bool(
        req.stream_options and req.stream_options.continuous_usage_stats
    )

    def chunk(choice: Choice, text: str, reason: str | None, logprobs: Any = None) -> str:
        out: dict[str, Any] = {
            "id": base,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": [
                {
                    "index": choice.index,
                    "text": text,
                    "finish_reason": reason,
                    "logprobs": logprobs,
                }
            ],
        }
        if include_usage:
            out["usage"] = _usage(choices) if continuous else None
        return sse_event(out)

    left = len(choices)
    try:
        while left:
            choice, reply = await merged.get()
            if isinstance(reply, ErrorReply):
                _fail(ctx, choice, reply, choices)
                error = {"message": reply.message, "type": "server_error", "code": reply.status}
                yield sse_event({"error": {**error, "param": None}})
                return
            done, text, logprobs = _on_reply(ctx, choice, reply)
            if text or logprobs is not None:
                yield chunk(choice, text, None, logprobs)
            if done:
                left -= 1
                yield chunk(choice, "", choice.finish_reason)
        if include_usage:
            yield sse_event(
                {
                    "id": base,
                    "object": "text_completion",
                    "created": created,
                    "model": ctx.model_name,
                    "choices": [],
                    "usage": _usage(choices),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        for p in pumps:
            p.cancel()
        if any(not c.tracker.done for c in choices):
            log.info("rid=%s client disconnected mid-stream", base)
            _abort_all(ctx, choices)
