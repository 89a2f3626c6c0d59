"""One streamed request against an OpenAI-compatible server, timed chunk by chunk."""

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from minisgl.bench.dataset import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when reported, else the intended
    output_len: int = 0  # usage.completion_tokens when reported, else content chunks seen
    ttft: float = 0.0  # seconds from sending to the first content chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    text: str = ""
    finish_reason: str | None = None


def request_body(
    backend: str, model: str, req: BenchRequest, ignore_eos: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        # vLLM/SGLang extension: generate exactly max_tokens, so output lengths are exact.
        body["ignore_eos"] = True
    body.update(extra)
    return body


def _content(chunk: dict[str, Any], backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if backend == "chat":
        delta = choice.get("delta") or {}
        # Reasoning models may stream thinking separately; it is generated output all the same.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    backend: str,
    req: BenchRequest,
    headers: dict[str, str],
) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return result
                now = time.perf_counter()
                text = _content(chunk, backend)
                if text:
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    result.text += text
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                usage = chunk.get("usage")
                if usage:
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                    result.output_len = usage.get("completion_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if result.output_len == 0:
        result.output_len = chunks
    if chunks == 0:
        # Without a content chunk there is no TTFT to report; a benchmark counts it as failed.
        result.error = "stream ended without a content chunk"
        return result
    result.success = True
    return result
