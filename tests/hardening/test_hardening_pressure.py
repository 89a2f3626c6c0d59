"""Memory pressure (KV need several times the pool: preemption and recompute) and an abort
storm, each checked against a quiet run on a roomy server; afterwards nothing is left."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening_support import (
    assert_worker_kill_is_fatal,
    run,
    start_servers,
    stream_completion,
    wait_clean,
)
from harness import ServerProcess

SMALL_PAGES = 16  # 256 tokens of KV; each request below needs ~115 (8 pages)
PAGE = 16


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    flags = {
        "roomy": ("--num-pages", "2048"),
        "small": ("--num-pages", str(SMALL_PAGES), "--max-prefill-tokens", "256"),
    }
    s = start_servers(tiny_model_dir, tmp_path_factory.mktemp("pressure"), flags)
    yield s
    for srv in s.values():
        srv.stop()


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(200, 100_000) for _ in range(30 + i % 7)]  # distinct: no shared prefix


async def _complete_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            if body.get("stream"):
                return await stream_completion(client, url, body)
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return {"status": 200, "text": c["text"], "finish_reason": c["finish_reason"]}

        return await asyncio.wait_for(asyncio.gather(*[one(b) for b in bodies]), timeout=150)


def _preemptions(srv: ServerProcess) -> tuple[int, float]:
    metrics = httpx.get(f"{srv.url}/metrics").text
    m = re.search(r"^minisgl_preemptions_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    return srv.stats()["scheduler"]["num_preemptions_total"], float(m.group(1)) if m else 0.0


def test_kv_need_beyond_the_pool_completes_by_preemption(servers: dict[str, ServerProcess]) -> None:
    n, out = 10, 80
    bodies: list[dict[str, Any]] = [{"prompt": _prompt(i), "max_tokens": out, "ignore_eos": True, "temperature": 0,
               "stream": i % 2 == 0} for i in range(n)]  # fmt: skip
    need_pages = sum(-(-(len(b["prompt"]) + out) // PAGE) for b in bodies)
    assert need_pages >= 4 * SMALL_PAGES  # several times the pool
    small, roomy = servers["small"], servers["roomy"]
    expected = run(_complete_all(f"{roomy.url}/v1/completions", bodies))
    got = run(_complete_all(f"{small.url}/v1/completions", bodies))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g["finish_reason"] == e["finish_reason"] == "length", (i, g, e)
        assert g["text"] == e["text"], f"request {i} differs after preemption"
    preempted, metric = _preemptions(small)
    assert preempted > 0 and metric > 0, (preempted, metric)
    print(f"memory pressure: {need_pages} pages needed of {SMALL_PAGES}, {preempted} preemptions")
    wait_clean(small)
    wait_clean(roomy)


def test_abort_storm_leaves_no_state_and_normal_requests_are_exact(
    servers: dict[str, ServerProcess],
) -> None:
    srv = servers["roomy"]
    url = f"{srv.url}/v1/completions"
    normal = [{"prompt": f"normal request {i}: tell me", "max_tokens": 24, "temperature": 0,
               "ignore_eos": True, "stream": i % 3 != 0} for i in range(20)]  # fmt: skip
    quiet = run(_complete_all(url, normal))
    rng = random.Random(7)
    stats: dict[str, int] = {"chunks": 0, "early": 0, "read": 0}

    async def storm() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def victim(i: int) -> None:
                body = {"prompt": f"victim {i}", "max_tokens": 400, "ignore_eos": True,
                        "stream": True, "temperature": 0.8}  # fmt: skip
                if i % 4 == 0:  # cancelled at a random time: maybe before the first byte
                    task = asyncio.ensure_future(stream_completion(client, url, body))
                    await asyncio.sleep(rng.uniform(0, 0.3))
                    task.cancel()
                    stats["early"] += 1
                    return
                res = await stream_completion(client, url, body, stop_after=rng.randint(1, 20))
                stats["read"] += 1
                stats["chunks"] += res.get("chunks", 0)

            async def normals() -> list[dict[str, Any]]:
                await asyncio.sleep(0.05)
                return await _complete_all(url, normal)

            victims = [victim(i) for i in range(100)]
            results = await asyncio.gather(normals(), *victims, return_exceptions=True)
            errors = [r for r in results[1:] if isinstance(r, BaseException)
                      and not isinstance(r, asyncio.CancelledError)]  # fmt: skip
            assert not errors, errors
            assert not isinstance(results[0], BaseException), results[0]
            return results[0]  # type: ignore[return-value]

    got = run(storm())
    for i, (g, q) in enumerate(zip(got, quiet)):
        assert g["text"] == q["text"] and g["finish_reason"] == q["finish_reason"], i
    print(f"abort storm: 100 victims ({stats}), 20 normal requests exact")
    final = wait_clean(srv)
    assert (
        final["scheduler"]["num_pages_free"] + final["scheduler"]["num_pages_cached"]
        == (final["scheduler"]["num_pages_total"])
    )


@pytest.mark.parametrize(("server", "worker"), [("roomy", "detokenizer"), ("small", "scheduler")])
def test_zz_killed_worker_is_fatal(
    servers: dict[str, ServerProcess], server: str, worker: str
) -> None:
    """Last in this module (each ends one of the module's servers)."""
    assert_worker_kill_is_fatal(servers[server], worker)
