"""The FastAPI app: OpenAI routes, health, metrics, and the background tasks of the process."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message.api_to_tokenizer import DetokenizeOnly, TokenizeOnly
from minisgl.message.detokenizer_to_api import ErrorReply, TokenizerReply
from minisgl.server.api_key import APIKeyCheck
from minisgl.server.arrivals import CountArrivals
from minisgl.server.body_limit import BodySizeLimit
from minisgl.server.chat_output import ChatOutput
from minisgl.server.chat_prompt import chat_prompt, template_kwargs
from minisgl.server.chat_prompt import generation_prompt as generation_prompt_of
from minisgl.server.context import ServerContext
from minisgl.server.errors import APIError, error_response, install_handlers
from minisgl.server.handlers import admit, serve_request
from minisgl.server.multi_choice import serve_prompts
from minisgl.server.playground import install_playground
from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    ModelCard,
    ModelList,
    TokenizeBody,
)
from minisgl.server.structured_request import chat_grammar, output_grammar
from minisgl.structured.reasoning_parser import THINK_END

log = logging.getLogger("minisgl.api")

READY_PING_TIMEOUT = 120.0  # the first ping waits behind nothing, but CI machines are slow
MONITOR_INTERVAL = 0.2
HEARTBEAT_INTERVAL = 1.0  # the tokenizer worker is asked this often whether its loop turns


class Hooks:
    """What the app needs from the launcher: which worker died, and how to stop the server."""

    def dead_worker(self) -> str | None:
        return None

    def listening(self) -> bool:
        return True

    def on_ready(self) -> None:
        pass

    def exit(self, code: int) -> None:
        pass


def build_app(ctx: ServerContext, hooks: Hooks) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.manager.start()
        tasks = [
            asyncio.create_task(_become_ready(ctx, hooks)),
            asyncio.create_task(_monitor(ctx, hooks)),
        ]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            ctx.manager.close()

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=ctx.args.max_request_body_bytes)
    # Added last, so it runs first: a request without the key is refused before its body is read.
    app.add_middleware(
        APIKeyCheck,
        api_key=ctx.args.api_key,
        metrics_require_key=ctx.args.metrics_require_api_key,
    )
    # Outermost: a generation request is counted from the moment the server starts on it.
    app.add_middleware(CountArrivals, arrivals=ctx.arrivals)

    # The bodies are declared as the pydantic models, so /openapi.json describes them; a
    # validation failure is a 400 (errors.install_handlers), an oversized body a 413.
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        arrival = getattr(request.state, "arrival", None) or time.time()
        prompt = chat_prompt(req, trusted=ctx.args.trust_request_chat_template)
        tools = prompt.tools
        kwargs = prompt.template_kwargs
        generation_prompt = prompt.add_generation_prompt
        grammar = chat_grammar(req)
        fields: dict[str, Any] = {
            "messages": prompt.messages,
            "chat_template_kwargs": kwargs,
            "add_generation_prompt": generation_prompt,
            "tools": tools,
        }
        output = ChatOutput(
            reasoning=ctx.reasoning_parser,
            tools=bool(tools) and ctx.tool_call_parser,
            special_tags=ctx.special_tags if req.skip_special_tokens else (),
            thinking=generation_prompt
            and _closes_think(grammar)
            and _prompt_opens_think(ctx, kwargs),
        )
        # The parsers read their tags even where the tokenizer marks them special.
        fields["keep_special"] = list(output.special_tags)
        return await serve_request(ctx, request, req, fields, "chat", arrival, grammar, output)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        arrival = getattr(request.state, "arrival", None) or time.time()
        try:
            prompts = req.prompts()
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        cap = ctx.args.max_prompts_per_request
        if len(prompts) > cap:
            raise APIError(
                400,
                f"at most {cap} prompts per request on this server (--max-prompts-per-request), "
                f"got {len(prompts)}",
                "prompt",
            )
        vocab = ctx.vocab_size
        batch: list[dict[str, Any]] = []
        for prompt in prompts:
            if isinstance(prompt, list) and vocab is not None:
                # Here, not only in the engine: an id beyond 64 bits could not even be sent.
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise APIError(
                        400, f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
                    )
            if isinstance(prompt, list) and not prompt:
                raise APIError(400, "prompt must not be empty", "prompt")
            batch.append(
                {"prompt_text": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}
            )
        grammar = output_grammar(req)
        if len(batch) > 1:
            bad_field = req.unsupported()
            if bad_field is not None:
                raise APIError(400, bad_field[1], bad_field[0])
            return await serve_prompts(ctx, request, req, batch, arrival, grammar)
        return await serve_request(ctx, request, req, batch[0], "completion", arrival, grammar)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        kwargs = template_kwargs(body, trusted=ctx.args.trust_request_chat_template)
        generation_prompt = generation_prompt_of(body, kwargs) if body.messages else True
        msg = TokenizeOnly(
            rid="tok-" + uuid.uuid4().hex[:24],
            prompt=body.prompt,
            messages=[m.template_dict() for m in body.messages] if body.messages else None,
            add_special_tokens=(
                body.add_special_tokens
                if body.add_special_tokens is not None
                else body.messages is None
            ),
            add_generation_prompt=generation_prompt,
            chat_template_kwargs=kwargs,
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            return_token_strs=body.return_token_strs,
        )
        reply = await _text_tool(msg)
        tokens = reply.tokens or []
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": ctx.max_seq_len,
                "tokens": tokens,
                "token_strs": reply.token_strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> JSONResponse:
        vocab = ctx.vocab_size
        bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary", "tokens")
        reply = await _text_tool(DetokenizeOnly("detok-" + uuid.uuid4().hex[:24], body.tokens))
        return JSONResponse({"prompt": reply.text or ""})

    async def _text_tool(msg: TokenizeOnly | DetokenizeOnly) -> TokenizerReply:
        admit(ctx)
        try:
            reply = await ctx.manager.text_tool(msg)
        except (TypeError, ValueError, OverflowError):
            raise APIError(400, "the request holds values that cannot be processed") from None
        except asyncio.TimeoutError:
            raise APIError(503, "the tokenizer did not answer in time") from None
        if isinstance(reply, ErrorReply):
            raise APIError(reply.status, reply.message, reply.param)
        assert isinstance(reply, TokenizerReply)
        return reply

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name, created=ctx.created, root=ctx.args.model, max_model_len=ctx.max_seq_len
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [card(name) for name in ctx.args.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    # `:path`: hub ids hold a slash (GET /v1/models/Qwen/Qwen3-0.6B).
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model not in ctx.args.model_names:
            raise APIError(404, f"The model '{model}' does not exist", "model")
        return JSONResponse(card(model).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if ctx.dead_worker:
            return error_response(503, ctx.dead_worker)
        if ctx.draining:
            return error_response(503, "draining")
        if not ctx.ready:
            return error_response(503, "starting")
        silence = ctx.manager.tokenizer_silence()
        if silence > ctx.args.tokenizer_health_timeout:
            return error_response(503, f"the tokenizer worker has not answered for {silence:.0f} s")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/internal/stats")
    async def internal_stats() -> JSONResponse:
        m = ctx.manager
        return JSONResponse(
            {
                "scheduler": m.stats,
                "stats_age_s": time.time() - m.stats_time if m.stats_time else None,
                "max_batch_size": m.max_batch_size,
                "recent_batch_sizes": list(m.recent_batch_sizes)[-256:],
                "batch_steps": m.batch_steps,
                "in_flight": len(m.requests),
                "pending_pings": len(m.pending_pings),
                "waiting_at_api": m.num_waiting,
                "workers": ctx.worker_pids,
                "ipc_dir": ctx.ipc_dir,
                "ready": ctx.ready,
                "draining": ctx.draining,
            }
        )

    if not ctx.args.disable_playground:
        install_playground(app)
    return app


def _closes_think(grammar: tuple[str, str] | None) -> bool:
    """Whether the output may close a think block the prompt opened: a grammar applies from
    the first token, so what it makes is the answer (a JSON object, a forced tool call)
    unless it writes `</think>` itself."""
    return grammar is None or THINK_END in grammar[1]


def _prompt_opens_think(ctx: ServerContext, kwargs: dict[str, Any]) -> bool:
    """Whether the model's template, under the request's enable_thinking, ends the prompt
    inside a think block (assumed not for a template the request brings)."""
    if "chat_template" in kwargs:
        return False
    switch = kwargs.get("enable_thinking")
    key = "true" if switch is True else "false" if switch is False else "unset"
    return ctx.prefilled_think.get(key, False)


async def _become_ready(ctx: ServerContext, hooks: Hooks) -> None:
    start = time.perf_counter()
    try:
        hops = await ctx.manager.ping(READY_PING_TIMEOUT)
    except asyncio.TimeoutError:
        log.error("no ping round trip through the workers in %.0f s", READY_PING_TIMEOUT)
        hooks.exit(1)
        return
    log.info("ping round trip through %s in %.3f s", " -> ".join(hops), time.perf_counter() - start)
    while not hooks.listening():  # uvicorn binds its socket after the lifespan startup
        await asyncio.sleep(0.02)
    ctx.ready = True
    hooks.on_ready()


async def _monitor(ctx: ServerContext, hooks: Hooks) -> None:
    """A worker that dies takes the server down, so an orchestrator restarts it whole; a
    tokenizer worker that stops answering (alive, but its loop stuck) fails /health."""
    last_beat = 0.0
    silent = False
    while True:
        await asyncio.sleep(MONITOR_INTERVAL)
        if time.monotonic() - last_beat >= HEARTBEAT_INTERVAL:
            last_beat = time.monotonic()
            ctx.manager.heartbeat()
        silence = ctx.manager.tokenizer_silence()
        if (silence > ctx.args.tokenizer_health_timeout) != silent:
            silent = not silent
            if silent:
                log.error("the tokenizer worker has not answered for %.0f s: unhealthy", silence)
            else:
                log.info("the tokenizer worker answers again")
        dead = hooks.dead_worker()
        if dead is not None and ctx.dead_worker is None:
            ctx.dead_worker = dead
            log.error("%s; failing in-flight requests and exiting", dead)
            ctx.manager.fail_all(f"{dead}", 503)
            hooks.exit(1)
            return
