"""Overload (200 streaming clients against a 8-deep waiting queue), a slow consumer, and a
SIGTERM under load, on one server (the SIGTERM test ends it, so it runs last)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening_support import run, start_servers, stream_completion, wait_clean
from harness import ServerProcess, pid_alive

QUEUE = 8
CLIENTS = 200


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--max-queued-requests", str(QUEUE), "--max-running-requests", "16",
             "--num-pages", "1024", "--shutdown-timeout", "30")  # fmt: skip
    s = start_servers(tiny_model_dir, tmp_path_factory.mktemp("overload"), {"load": flags})
    yield s["load"]
    s["load"].stop()


def _body(i: int, n: int = 8) -> dict[str, Any]:
    return {"prompt": f"client {i} says", "max_tokens": n, "ignore_eos": True, "temperature": 0}


async def _later(delay: float, coro: Any) -> Any:
    await asyncio.sleep(delay)
    return await coro


def test_200_streams_complete_or_get_503_with_retry_after(srv: ServerProcess) -> None:
    url = f"{srv.url}/v1/completions"

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            # Half arrive at once (the queue bound is hit), half trickle in over ~2 s.
            tasks = [_later(i * 0.02 if i % 2 else 0.0, stream_completion(client, url, _body(i)))
                     for i in range(CLIENTS)]  # fmt: skip
            # Nothing may hang: the whole burst has a hard bound.
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    start = time.monotonic()
    results = run(main())
    wall = time.monotonic() - start
    done = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    assert len(done) + len(refused) == CLIENTS, [
        r for r in results if r["status"] not in (200, 503)
    ]
    for r in done:
        assert r["done"] and r["finish_reason"] == "length" and r["text"], r
    for r in refused:
        assert r["retry_after"] and int(r["retry_after"]) >= 1
        assert r["body"]["error"]["type"] == "service_unavailable_error"
    assert done and refused  # the bound was reached, and the server kept serving through it
    print(f"overload: {len(done)} completed, {len(refused)} refused (503) in {wall:.1f} s")
    wait_clean(srv)
    again = httpx.post(url, json=_body(0), timeout=30)  # admission reopened
    assert again.status_code == 200


def test_a_client_that_stops_reading_does_not_stall_others(srv: ServerProcess) -> None:
    url = f"{srv.url}/v1/completions"
    body = json.dumps({**_body(1, 1500), "stream": True}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few chunks
    slow.connect(("127.0.0.1", srv.port))
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        time.sleep(0.5)  # it is streaming now, into a socket nobody reads

        async def others() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=30) as client:
                tasks = [stream_completion(client, url, _body(i, 32)) for i in range(4)]
                return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

        start = time.monotonic()
        results = run(others())
        assert all(r["status"] == 200 and r["finish_reason"] == "length" for r in results)
        elapsed = time.monotonic() - start
        assert elapsed < 15, elapsed
        # The slow stream is still held (generated, waiting on its socket), not lost.
        assert srv.stats()["in_flight"] == 1
    finally:
        slow.close()
    wait_clean(srv)


def test_sigterm_under_load_drains_every_stream(srv: ServerProcess) -> None:
    stats = srv.stats()
    workers, ipc_dir = stats["workers"], stats["ipc_dir"]
    url = f"{srv.url}/v1/completions"
    n_streams, n_tokens = 6, 60
    started = asyncio.Event()
    seen: dict[str, Any] = {}

    async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body = {**_body(i, n_tokens), "stream": True, "stream_options": {"include_usage": True}}
        lines: list[str] = []
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    started.set()
        return {"lines": lines}

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(n_streams)]
            await asyncio.wait_for(started.wait(), 30)
            srv.signal(signal.SIGTERM)
            deadline = time.monotonic() + 60  # the drain starts on the server's event loop
            while (await client.get(f"{srv.url}/health")).status_code != 503:
                assert time.monotonic() < deadline, "no drain after SIGTERM"
                await asyncio.sleep(0.05)
            seen["health"] = (await client.get(f"{srv.url}/health")).status_code
            late = await client.post(url, json=_body(99))
            seen["new"] = (late.status_code, late.headers.get("retry-after"))
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    results = run(main())
    for r in results:
        assert r["lines"][-1] == "data: [DONE]"
        usage = json.loads(r["lines"][-2][6:])["usage"]
        finish = json.loads(r["lines"][-3][6:])["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == n_tokens and finish == "length"
    assert seen["health"] == 503 and seen["new"][0] == 503 and seen["new"][1]
    assert srv.proc.wait(30) == 0
    assert not any(pid_alive(p) for p in workers.values())
    assert not Path(ipc_dir).exists()
