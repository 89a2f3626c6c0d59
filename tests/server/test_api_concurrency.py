"""Continuous batching seen from HTTP, and client disconnects freeing KV pages fast."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from harness import ServerProcess

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


async def _timed_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    start = time.monotonic()
    first = None
    text = ""
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                first = first or time.monotonic()
            if line.startswith("data: [DONE]"):
                break
            text += line
    return {"start": start, "first": first, "end": time.monotonic(), "raw": text}


def test_eight_concurrent_requests_share_one_batch(server: ServerProcess) -> None:
    steps_before = server.stats()["batch_steps"]
    url = f"{server.url}/v1/completions"
    body = {"prompt": "Count with me:", "max_tokens": 16, "ignore_eos": True, "stream": True}

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[_timed_stream(client, url, body) for _ in range(8)])

    results = asyncio.run(run())
    durations = [r["end"] - r["start"] for r in results]
    ends = [r["end"] for r in results]
    # One batch: they finish together (within 20% of the slowest one's latency).
    assert max(ends) - min(ends) <= 0.2 * max(durations), durations
    # Stats arrive every 0.25 s, later on a busy machine: wait for the batch to show.
    deadline = time.monotonic() + 60
    while True:
        stats = server.stats()
        new_steps = stats["batch_steps"] - steps_before
        sizes = stats["recent_batch_sizes"][-new_steps:] if new_steps > 0 else [0]
        if max(sizes) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert max(sizes) == 8, sizes
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "minisgl_batch_size_bucket" in metrics


def test_stream_killed_after_five_chunks_frees_everything(server: ServerProcess) -> None:
    url = f"{server.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True, **LONG}
    chunks = 0
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept open: leaving the iterator early would close the stream
        while chunks < 5:
            line = next(lines)
            if '"content":"' in line and '"content":""' not in line:
                chunks += 1
        # The request holds pages while it streams (stats lag by up to 0.25 s).
        deadline = time.monotonic() + 60.0
        while server.stats()["scheduler"]["num_pages_used"] == 0:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.05)
        r.close()  # the client goes away mid-stream
    assert chunks == 5
    # A condition with a generous deadline: a busy 2-core machine may take seconds to get there.
    idle = server.wait_idle()
    assert idle["num_pages_used"] == 0 and idle["num_running"] == 0
    assert "client disconnected" in server.logs()


def test_non_stream_client_gone_frees_everything(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={"prompt": "wait for me", **LONG}, timeout=1.0)
    server.wait_idle()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'minisgl_requests_total{finish_reason="abort"' in metrics
