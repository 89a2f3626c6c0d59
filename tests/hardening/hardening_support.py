"""Shared helpers of the hardening suite: parallel server start, raw streams, leak checks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from harness import ServerProcess, pid_alive

# Small pages keep the fixture's memory low; info logs make failures readable.
BASE_FLAGS = ("--page-size", "16", "--log-level", "info")


def start_servers(
    model_dir: Path, log_dir: Path, flag_sets: dict[str, tuple[str, ...]]
) -> dict[str, ServerProcess]:
    """Start several servers at once (their start-up overlaps) and wait until all are ready."""
    servers = {
        name: ServerProcess(model_dir, log_dir / f"{name}.log", *BASE_FLAGS, *flags)
        for name, flags in flag_sets.items()
    }
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.wait_ready(), servers.values()))
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def wait_clean(server: ServerProcess, within: float = 60.0) -> dict[str, Any]:
    """/internal/stats once nothing is left anywhere: no request, page or per-request state in
    the scheduler, the detokenizer or the API server. Fails with the stats after `within` s."""
    deadline = time.monotonic() + within
    while True:
        stats = server.stats()
        s = stats["scheduler"]
        left = {
            "running": s.get("num_running"),
            "waiting": s.get("num_waiting"),
            "pages_used": s.get("num_pages_used"),
            "engine_live": s.get("engine_live_requests"),
            "detokenizer_live": s.get("detokenizer_live_requests"),
            "api_in_flight": stats["in_flight"],
            "api_waiting": stats["waiting_at_api"],
            "api_pings": stats.get("pending_pings"),
        }
        if all(v == 0 for v in left.values()) and (stats.get("stats_age_s") or 9) < 1.0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"state left after {within} s: {left}")
        time.sleep(0.05)


def sse_payloads(raw_lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for line in raw_lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_of(payloads: list[Any]) -> str:
    parts: list[str] = []
    for p in payloads:
        if isinstance(p, dict):
            for c in p.get("choices", []):
                parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """One streamed completion: status, Retry-After, the text and finish_reason (or the
    number of chunks read before the client hung up, with stop_after)."""
    lines: list[str] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "body": r.json()}  # fmt: skip
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
            if stop_after is not None and len(lines) >= stop_after:
                return {"status": 200, "cancelled": True, "chunks": len(lines)}
    payloads = sse_payloads(lines)
    finish = [
        c.get("finish_reason")
        for p in payloads
        if isinstance(p, dict)
        for c in p.get("choices", [])
        if c.get("finish_reason")
    ]
    return {
        "status": 200,
        "text": text_of(payloads),
        "finish_reason": finish[-1] if finish else None,
        "done": bool(payloads) and payloads[-1] == "[DONE]",
    }


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- faults: each module's last test kills one worker of its own server ----------------
def _stream_until_it_ends(srv: ServerProcess, out: dict[str, Any], first: threading.Event) -> None:
    body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                first.set()
                if line.startswith('data: {"error"'):
                    out["error_event"] = True
    except httpx.HTTPError as exc:  # the connection dropped: also an end, not a hang
        out["dropped"] = type(exc).__name__
    first.set()
    out["ended"] = time.monotonic()


def assert_worker_kill_is_fatal(srv: ServerProcess, worker: str) -> None:
    """kill -9 of one worker mid-stream: /health fails, the stream ends (no hang), the server
    exits non-zero within seconds, leaving no worker and no socket directory behind."""
    stats = srv.stats()
    workers, ipc_dir = stats["workers"], stats["ipc_dir"]
    out: dict[str, Any] = {}
    first = threading.Event()
    reader = threading.Thread(target=_stream_until_it_ends, args=(srv, out, first), daemon=True)
    reader.start()
    assert first.wait(20)  # the stream is under way
    killed = time.monotonic()
    os.kill(workers[worker], signal.SIGKILL)
    unhealthy = None
    while time.monotonic() - killed < 15:
        if srv.proc.poll() is not None:  # gone between two probes: its /health fails too
            unhealthy = unhealthy or time.monotonic() - killed
            break
        try:
            if httpx.get(f"{srv.url}/health", timeout=1).status_code == 503 and unhealthy is None:
                unhealthy = time.monotonic() - killed
        except httpx.HTTPError:
            unhealthy = unhealthy or time.monotonic() - killed  # already gone: also a failure
        time.sleep(0.05)
    code = srv.proc.wait(15)
    exited = time.monotonic() - killed
    reader.join(15)
    assert code != 0
    assert unhealthy is not None and unhealthy < 3, unhealthy
    assert exited < 10, exited
    assert "ended" in out and out["ended"] - killed < 10, out  # the client was not left hanging
    assert not any(pid_alive(p) for p in workers.values())
    assert not os.path.exists(ipc_dir)
    assert f"{worker} worker" in srv.logs() and "died" in srv.logs()
    print(
        f"{worker} killed: /health failed after {unhealthy:.2f} s, exit {code} after {exited:.2f} s"
    )
