"""Soak test: steady load for N minutes, then latency drift and memory growth per process.

    python benchmarks/soak.py                          # 1 minute on the offline fixture model
    python benchmarks/soak.py --model DIR --minutes 30 --concurrency 16
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --minutes 10

Without --base-url it starts `python -m minisgl` itself (on the tiny fixture model unless
--model is given). Load: `--concurrency` clients in a loop, each sending streamed completions
and chats of random length; one in ten is abandoned mid-stream, so the abort path is soaked
too. Reported:
  - latency drift: p50/p99 of end-to-end latency and TTFT in the first vs the last window
    (`--window` of the run each);
  - RSS of every process (API server, tokenizer, detokenizer, scheduler) after a warm-up and
    after the load, and the growth;
  - what is left afterwards (/internal/stats: requests, pages, per-request state).
Exits 1 when a request failed or state was left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from minisgl.testing.live_server import free_port, wait_http_ok

READY_TIMEOUT = 300.0


@dataclass
class Sample:
    start: float  # seconds since the load began
    latency: float
    ttft: float | None
    ok: bool
    abandoned: bool = False
    error: str = ""
    tokens: int = 0  # content chunks seen (one token each, give or take a split character)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first: independent of the random lengths."""
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)


def start_server(model: str | None, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    if model is None:
        from minisgl.testing.fixture import write_fixture_model

        model = str(write_fixture_model(Path(tempfile.mkdtemp(prefix="soak-model-")), "tiny"))
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(port), *extra]
    if "--dtype" not in extra:
        cmd += ["--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    if wait_http_ok(proc, f"{url}/health", READY_TIMEOUT, interval_s=0.3):
        return proc, url
    if proc.poll() is not None:
        raise SystemExit(f"server exited with {proc.returncode}; see {log}")
    proc.kill()
    raise SystemExit(f"server not ready in {READY_TIMEOUT:.0f} s; see {log}")


def processes(url: str, headers: dict[str, str]) -> dict[str, psutil.Process]:
    """The server's processes by role: the workers from /internal/stats, the API server is
    their parent."""
    stats = httpx.get(f"{url}/internal/stats", headers=headers, timeout=10).json()
    procs = {name: psutil.Process(pid) for name, pid in stats["workers"].items()}
    parent = next(iter(procs.values())).parent()
    assert parent is not None
    return {"api_server": parent, **procs}


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: p.memory_info().rss / 2**20 for name, p in procs.items()}


async def one_request(
    client: httpx.AsyncClient, url: str, rng: random.Random, t0: float, max_tokens: int
) -> Sample:
    words = " ".join(rng.choice(["alpha", "beta", "中文", "🙂", "gamma", "delta"]) for _ in
                     range(rng.randint(4, 200)))  # fmt: skip
    n = rng.randint(1, max_tokens)
    body: dict[str, Any]
    if rng.random() < 0.5:
        path, body = "/v1/completions", {"prompt": words}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}
    body.update(max_tokens=n, ignore_eos=True, stream=True, temperature=rng.choice([0.0, 0.8]))
    abandon_after = rng.randint(1, max(1, n // 2)) if rng.random() < 0.1 else None
    start = time.monotonic()
    ttft = None
    chunks = 0
    tokens = 0
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Sample(start - t0, time.monotonic() - start, None, False,
                              error=f"{r.status_code} {r.text[:100]}")  # fmt: skip
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                has_text = '"text":"' in line or '"content":"' in line
                empty = '"text":""' in line or '"content":""' in line
                if has_text and not empty:
                    tokens += 1
                    if ttft is None:
                        ttft = time.monotonic() - start
                if abandon_after is not None and chunks >= abandon_after:
                    return Sample(start - t0, time.monotonic() - start, ttft, True, True)
    except httpx.HTTPError as exc:
        return Sample(start - t0, time.monotonic() - start, ttft, False, error=repr(exc))
    return Sample(start - t0, time.monotonic() - start, ttft, True, tokens=tokens)


async def load(url: str, headers: dict[str, str], seconds: float, conc: int, max_tokens: int,
               seed: int) -> list[Sample]:  # fmt: skip
    samples: list[Sample] = []
    t0 = time.monotonic()

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            while time.monotonic() - t0 < seconds:
                samples.append(await one_request(client, url, rng, t0, max_tokens))

    await asyncio.gather(*[client_loop(i) for i in range(conc)])
    return samples


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def window_stats(samples: list[Sample]) -> dict[str, float]:
    full = [s for s in samples if s.ok and not s.abandoned]
    lat = [s.latency for s in full]
    ttft = [s.ttft for s in samples if s.ok and s.ttft is not None]
    tpot = [t for s in full if (t := s.tpot) is not None]
    return {
        "requests": len(full),
        "latency_p50_s": pct(lat, 50),
        "latency_p99_s": pct(lat, 99),
        "ttft_p50_s": pct(ttft, 50),  # type: ignore[arg-type]
        "ttft_p99_s": pct(ttft, 99),  # type: ignore[arg-type]
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
    }


def leftovers(url: str, headers: dict[str, str], within: float = 10.0) -> dict[str, Any]:
    """Per-request state still held once idle (all zero when nothing leaked)."""
    deadline = time.monotonic() + within
    while True:
        st = httpx.get(f"{url}/internal/stats", headers=headers, timeout=10).json()
        s = st["scheduler"]
        left = {
            "running": s.get("num_running"),
            "waiting": s.get("num_waiting"),
            "pages_used": s.get("num_pages_used"),
            "engine_live": s.get("engine_live_requests", 0),
            "detokenizer_live": s.get("detokenizer_live_requests", 0),
            "api_in_flight": st["in_flight"],
        }
        if all(v == 0 for v in left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--base-url", help="soak a running server instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("MINISGL_API_KEY"))
    ap.add_argument("--model", help="model for the server this script starts (default: fixture)")
    ap.add_argument("--server-args", default="--num-pages 1024",
                    help="extra flags for the started server")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--window", type=float, default=0.2, help="fraction of the run per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args()
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    proc = None
    if a.base_url:
        url = a.base_url.rstrip("/")
    else:
        log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        print(f"starting server (log {log})", flush=True)
        proc, url = start_server(a.model, a.server_args.split(), log)
    try:
        procs = processes(url, headers)
        seconds = a.minutes * 60
        warm = asyncio.run(load(url, headers, min(5.0, seconds / 10), a.concurrency,
                                a.max_tokens, a.seed + 1))  # fmt: skip
        leftovers(url, headers)
        before = rss_mb(procs)
        print(f"warm-up: {len(warm)} requests; soaking {a.minutes:g} min at concurrency "
              f"{a.concurrency}", flush=True)  # fmt: skip
        samples = asyncio.run(load(url, headers, seconds, a.concurrency, a.max_tokens, a.seed))
        left = leftovers(url, headers)
        after = rss_mb(procs)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    span = max(s.start for s in samples) if samples else 0.0
    first = window_stats([s for s in samples if s.start <= a.window * span])
    last = window_stats([s for s in samples if s.start >= (1 - a.window) * span])
    failed = [s for s in samples if not s.ok]
    report = {
        "minutes": a.minutes,
        "requests": len(samples),
        "abandoned": sum(s.abandoned for s in samples),
        "failed": len(failed),
        "failures": sorted({s.error for s in failed})[:5],
        "first_window": first,
        "last_window": last,
        "drift_latency_p50": last["latency_p50_s"] / first["latency_p50_s"],
        "drift_latency_p99": last["latency_p99_s"] / first["latency_p99_s"],
        "drift_tpot_p50": last["tpot_p50_s"] / first["tpot_p50_s"],
        "drift_tpot_p99": last["tpot_p99_s"] / first["tpot_p99_s"],
        "rss_mb_before": before,
        "rss_mb_after": after,
        "rss_mb_growth": {k: after[k] - before[k] for k in before},
        "left_after": left,
    }
    print(f"\n{len(samples)} requests in {a.minutes:g} min ({report['abandoned']} abandoned "
          f"mid-stream, {len(failed)} failed)")  # fmt: skip
    cols = ("latency", "ttft", "tpot")
    print(f"{'window':<8}{'n':>6}" + "".join(f"{c + ' p50':>12}{c + ' p99':>12}" for c in cols))
    for name, w in (("first", first), ("last", last)):
        row = "".join(f"{w[c + '_p50_s']:>12.4f}{w[c + '_p99_s']:>12.4f}" for c in cols)
        print(f"{name:<8}{w['requests']:>6}{row}")
    print(
        f"drift (last/first): latency p50 x{report['drift_latency_p50']:.2f} "
        f"p99 x{report['drift_latency_p99']:.2f}; per-token p50 x{report['drift_tpot_p50']:.2f} "
        f"p99 x{report['drift_tpot_p99']:.2f}"
    )
    print(f"{'process':<14}{'RSS before MB':>15}{'after MB':>10}{'growth MB':>11}")
    for k in before:
        print(f"{k:<14}{before[k]:>15.1f}{after[k]:>10.1f}{after[k] - before[k]:>+11.1f}")
    print(f"left after the load: {left}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 1 if failed or any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
