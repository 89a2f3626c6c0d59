"""A tiny OpenAI-compatible streaming server for testing the benchmark client.

Every request streams exactly max_tokens chunks of one word each, `delay_s` apart, then a usage
chunk; prompt_tokens is the prompt's word count. It records what it was sent and the peak
number of streams open at once.
"""

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stub-model"


@dataclass
class StubState:
    delay_s: float = 0.002
    max_tokens_limit: int = 1000  # requests asking for more get HTTP 400
    bodies: list[dict[str, Any]] = field(default_factory=list)
    open_streams: int = 0
    peak_streams: int = 0


def make_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        state.open_streams += 1
        state.peak_streams = max(state.peak_streams, state.open_streams)
        try:
            if chat:
                prompt = " ".join(m["content"] for m in body["messages"])
            else:
                prompt = body["prompt"]
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(state.delay_s)
                piece = {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
                reason = "length" if i == n - 1 else None
                chunk = {"choices": [{"index": 0, **piece, "finish_reason": reason}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state.open_streams -= 1

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        if body["max_tokens"] > state.max_tokens_limit:
            return JSONResponse({"error": {"message": "too many tokens"}}, status_code=400)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@contextmanager
def serve_stub(state: StubState) -> Iterator[str]:
    """Runs the stub on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("stub server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
