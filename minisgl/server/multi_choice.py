"""/v1/completions with a list of prompts: one engine request per choice, answered together.

Choice `index` = prompt_index * n + sample (OpenAI's and vLLM's numbering), so samples per
prompt plug in as more choices. Each choice is its own request through the pipeline (its own
rid, tracker and metrics); the reply merges them: one response, or one SSE stream whose chunks
carry their choice's index, with usage summed over the choices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.message.api_to_tokenizer import TokenizeRequest
from minisgl.message.detokenizer_to_api import ErrorReply, TextOutput
from minisgl.server.context import ServerContext
from minisgl.server.errors import APIError, error_response
from minisgl.server.handlers import Tracker, admit, sampling_params
from minisgl.server.manager import RequestState
from minisgl.server.protocol import CompletionRequest

log = logging.getLogger("minisgl.api")


@dataclass
class Choice:
    index: int
    tracker: Tracker
    state: RequestState
    text: str = ""
    finish_reason: str | None = None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def serve_prompts(
    ctx: ServerContext,
    request: Request,
    req: CompletionRequest,
    prompts: list[dict[str, Any]],
    arrival: float,
    grammar: tuple[str, str] | None,
) -> Response:
    """`prompts`: the TokenizeRequest fields of each prompt (prompt_text or prompt_ids)."""
    admit(ctx)
    base = "cmpl-" + uuid.uuid4().hex[:24]
    samples = req.n
    choices: list[Choice] = []
    try:
        for p_index, fields in enumerate(prompts):
            for sample in range(samples):
                index = p_index * samples + sample
                rid = f"{base}-{index}"
                params = sampling_params(ctx, req, req.limit(), grammar)
                tok_req = TokenizeRequest(
                    rid=rid,
                    arrival_time=arrival,
                    params=params,
                    max_tokens=req.limit(),
                    skip_special_tokens=req.skip_special_tokens,
                    **fields,
                )
                state = ctx.manager.submit(tok_req)
                choices.append(Choice(index, Tracker(rid, arrival, req.stream), state))
    except (TypeError, ValueError, OverflowError):
        _abort_all(ctx, choices)
        raise APIError(400, "the request holds values that cannot be processed") from None
    except BaseException:
        _abort_all(ctx, choices)
        raise
    log.info("rid=%s received: completion of %d prompts stream=%s", base, len(prompts), req.stream)
    merged: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(c, merged)) for c in choices]
    if req.stream:
        return StreamingResponse(
            _stream(ctx, base, req, choices, merged, pumps),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect(ctx, request, base, choices, merged, pumps)


async def _pump(choice: Choice, merged: asyncio.Queue[tuple[Choice, Any]]) -> None:
    while True:
        reply = await choice.state.queue.get()
        await merged.put((choice, reply))
        if not isinstance(reply, TextOutput) or reply.finished:
            return


def _abort_all(ctx: ServerContext, choices: list[Choice]) -> None:
    for c in choices:
        if not c.tracker.done:
            ctx.manager.abort(c.tracker.rid)
            c.tracker.finish(ctx, "abort")


def _usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.tracker.prompt_tokens for c in choices)
    completion = sum(c.tracker.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.tracker.cached_tokens for c in choices)},
    }


def _on_reply(ctx: ServerContext, choice: Choice, reply: Any) -> bool:
    """Account one reply; True once the choice is finished."""
    choice.tracker.on_output(reply)
    choice.text += reply.text
    if not reply.finished:
        return False
    ctx.manager.release(choice.tracker.rid)
    choice.finish_reason = reply.finish_reason or "stop"
    choice.tracker.finish(ctx, choice.finish_reason)
    return True


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
                ctx.manager.release(choice.tracker.rid)
                choice.tracker.finish(ctx, "error")
                _abort_all(ctx, choices)
                return error_response(reply.status, reply.message, reply.param)
            left -= _on_reply(ctx, choice, reply)
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
        "choices": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            for c in choices
        ],
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

    def chunk(choice: Choice, text: str, reason: str | None) -> str:
        out: dict[str, Any] = {
            "id": base,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": [
                {"index": choice.index, "text": text, "finish_reason": reason, "logprobs": None}
            ],
        }
        if include_usage:
            out["usage"] = _usage(choices) if continuous else None
        return _sse(out)

    left = len(choices)
    try:
        while left:
            choice, reply = await merged.get()
            if isinstance(reply, ErrorReply):
                ctx.manager.release(choice.tracker.rid)
                choice.tracker.finish(ctx, "error")
                _abort_all(ctx, choices)
                error = {"message": reply.message, "type": "server_error", "code": reply.status}
                yield _sse({"error": {**error, "param": None}})
                return
            done = _on_reply(ctx, choice, reply)
            if reply.text:
                yield chunk(choice, reply.text, None)
            if done:
                left -= 1
                yield chunk(choice, "", choice.finish_reason)
        if include_usage:
            yield _sse(
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
