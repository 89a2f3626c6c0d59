"""Drives a list of requests at a server: Poisson arrivals under a concurrency cap."""

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm.asyncio import tqdm

from minisgl.bench.client import ENDPOINTS, RequestResult, request_body, send_request
from minisgl.bench.dataset import BenchRequest


@dataclass(frozen=True)
class Target:
    base_url: str
    backend: str  # "completions" or "chat"
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 3600.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.backend]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def http_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


async def arrivals(
    requests: Sequence[BenchRequest], rate: float, rng: random.Random
) -> AsyncIterator[BenchRequest]:
    """Yields requests with exponential gaps (a Poisson process), or all at once for inf."""
    for i, req in enumerate(requests):
        if i and not math.isinf(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield req


async def run_one(client: httpx.AsyncClient, target: Target, req: BenchRequest) -> RequestResult:
    body = request_body(target.backend, target.model, req, target.ignore_eos, target.extra_body)
    return await send_request(client, target.url, body, target.backend, req, target.headers)


async def warmup(target: Target, req: BenchRequest, n: int) -> list[RequestResult]:
    """A few short requests first, so one-time costs (connections, lazy init) stay out."""
    if n <= 0:
        return []
    async with http_client(n, target.timeout_s) as client:
        short = replace(req, output_len=min(req.output_len, 16))
        return list(await asyncio.gather(*(run_one(client, target, short) for _ in range(n))))


async def benchmark(
    target: Target,
    requests: Sequence[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 1,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Results in request order, and the wall time from the first send to the last reply."""
    limit = max_concurrency or len(requests) or 1
    gate = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")
    rng = random.Random(seed)

    async def guarded(client: httpx.AsyncClient, req: BenchRequest) -> RequestResult:
        async with gate:
            result = await run_one(client, target, req)
        bar.update(1)
        return result

    async with http_client(limit, target.timeout_s) as client:
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(guarded(client, req))
            async for req in arrivals(requests, request_rate, rng)
        ]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    bar.close()
    return results, duration
