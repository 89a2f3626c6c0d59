"""Where a request's time goes outside the forward pass (the per-request timeline).

Starts `python -m minisgl` with MINISGL_TIMELINE set (see minisgl/timeline.py) on the random
Qwen3-0.6B-shaped model and sends --requests requests of each --kinds one at a time at idle
through the official openai client (one client, keep-alive, as an application): a 6-token chat
turn ("chat") and a short completion prompt ("completion"), each streamed ("...-stream") and
not. For each kind it prints the median of every hop from HTTP received to the first byte
written (stream) or the reply written (not), TTFT at the client minus the prefill forward, and
for streams the inter-token latency at the client against the decode step the scheduler timed.
Targets (issue 12): TTFT at idle <= one prefill forward + 15 ms; ITL <= one decode step + 3 ms.

    python benchmarks/serving_timeline.py [--model DIR] [--requests 5] [--max-tokens 64]
    python benchmarks/serving_timeline.py --kinds completion-stream --max-tokens 1
    python benchmarks/serving_timeline.py --burst 8 --max-tokens 16   # 8 clients at once

With --burst N, N streamed completions of a 128-word prompt are sent at once (as the serving
benchmark's concurrent workloads do) and each step of the burst is printed: when it ran, how
long, how many requests were queued since the step before and how many it gave their first
token, so a burst's split into steps and each request's wait for its first token show.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minisgl import timeline
from minisgl.layers.cpu_build import cpu_info
from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

PROMPT = "The quick brown fox jumps"  # a handful of tokens
CHAT = [{"role": "user", "content": "Name three colors."}]  # 6 tokens before the template's
KINDS = ("chat-stream", "chat", "completion-stream", "completion")


def send_one(client: Any, kind: str, max_tokens: int) -> tuple[float, list[float], float]:
    """(seconds to the first content, wall-clock arrival times of every content chunk (the
    whole reply's, not streamed), wall-clock send time)."""
    stream = kind.endswith("-stream")
    common = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    common["extra_body"] = {"ignore_eos": True}
    times: list[float] = []
    t0 = time.time()
    if kind.startswith("chat"):
        reply = client.chat.completions.create(messages=CHAT, **common)
    else:
        reply = client.completions.create(prompt=PROMPT, **common)
    if not stream:
        return time.time() - t0, [time.time()], t0
    for chunk in reply:
        choice = chunk.choices[0] if chunk.choices else None
        text = (choice.delta.content if kind.startswith("chat") else choice.text) if choice else ""
        if text:
            times.append(time.time())
    return times[0] - t0, times, t0


def send_burst(base: str, n: int, max_tokens: int) -> list[float]:
    """n streamed completions at once (one thread each); each one's seconds to its first text."""
    import concurrent.futures

    import openai

    def one(i: int) -> float:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        prompt = " ".join(f"word{(i * 131 + j) % 997}" for j in range(128))
        return send_one_prompt(client, prompt, max_tokens)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def send_one_prompt(client: Any, prompt: str, max_tokens: int) -> float:
    t0 = time.time()
    reply = client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    for chunk in reply:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.time() - t0
    return first if first is not None else time.time() - t0


def burst_steps(
    events: dict[str, list[tuple[str, float]]], steps: list[tuple[str, float]]
) -> list[tuple[float, float, int, int]]:
    """The steps from the burst's first arrival on: (start and length in seconds from that
    arrival, requests queued since the step before it, requests it gave their first token)."""
    firsts = [dict(reversed(ev)) for ev in events.values()]
    firsts = [f for f in firsts if "received" in f]
    if not firsts:
        return []
    t0 = min(f["received"] for f in firsts)
    spans = [
        (ta, tb)
        for (a, ta), (b, tb) in zip(steps, steps[1:])
        if a == "step_begin" and b == "step_end" and ta >= t0
    ]
    out = []
    for i, (ta, tb) in enumerate(spans):
        # "scheduled" is marked just before the step begins, "forwarded" just after it ends.
        nxt = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        began = sum(1 for f in firsts if ta - 0.01 <= f.get("scheduled", -1.0) <= ta)
        gave = sum(1 for f in firsts if tb <= f.get("forwarded", -1.0) < nxt)
        out.append((ta - t0, tb - ta, began, gave))
    return out


def gaps(events: list[tuple[str, float]]) -> dict[str, float]:
    first = {}
    for stage, t in events:
        first.setdefault(stage, t)
    stages = [st for st in timeline.STAGES if st in first]
    return {f"{a} -> {b}": first[b] - first[a] for a, b in zip(stages, stages[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model dir (default: the random 0.6B fixture, bf16)")
    ap.add_argument("--fixture-dir", default="/tmp/minisgl-bench-models")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"some of {', '.join(KINDS)}")
    ap.add_argument("--extra", default="", help="more server flags, space-separated")
    ap.add_argument("--burst", type=int, default=0, help="send this many requests at once")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if args.model:
        model = Path(args.model)
    else:
        from minisgl.testing.fixture import write_fixture_model

        model = Path(args.fixture_dir) / "qwen3-0.6b-bfloat16"
        if not (model / "config.json").is_file():
            write_fixture_model(model, preset="0.6b", dtype="bfloat16")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    runs: dict[str, list[tuple[float, list[float], float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tl = os.path.join(tmp, "timeline.txt")
        cmd = [sys.executable, "-m", "minisgl", "--model", str(model), "--dtype", "bfloat16"]
        cmd += ["--device", "cpu", "--port", str(port), "--num-pages", "512"]
        cmd += args.extra.split()
        log = open(os.path.join(tmp, "server.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MINISGL_TIMELINE": tl},
            start_new_session=True,
        )
        try:
            if not wait_http_ok(proc, base + "/health", 900, interval_s=1.0, probe_timeout_s=2.0):
                print(Path(tmp, "server.log").read_text()[-3000:])
                return 1
            import openai

            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            for kind in kinds:
                send_one(client, kind, 4)  # warm-up (and the connection opened)
            Path(tl).write_text("")
            if args.burst:
                ttfts = send_burst(base, args.burst, args.max_tokens)
                kinds = []
            for kind in kinds:
                for _ in range(args.requests):
                    runs.setdefault(kind, []).append(send_one(client, kind, args.max_tokens))
                    time.sleep(0.3)  # idle between requests
            events = timeline.read(tl)
        finally:
            stop_process(proc, 60.0, group=True)
    steps = events.pop("-", [])
    durations = [
        b[1] - a[1] for a, b in zip(steps, steps[1:]) if a[0] == "step_begin" and b[0] == "step_end"
    ]
    between = [
        b[1] - a[1]
        for a, b in zip(steps, steps[1:])
        if a[0] == "step_end" and b[0] == "step_begin" and b[1] - a[1] < 0.25
    ]
    name, flags = cpu_info()
    noted = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    print(f"CPU: {name} [{noted}], {os.cpu_count()} cores")
    if args.burst:
        print(f"a burst of {args.burst} streamed completions, {args.max_tokens} tokens each")
        for start, length, began, gave in burst_steps(events, steps):
            print(f"  step at {start * 1e3:8.1f} ms, {length * 1e3:7.1f} ms: {began:3d} newly "
                  f"queued, first tokens for {gave:3d}")  # fmt: skip
        ttfts.sort()
        print(f"  TTFT (client) mean {statistics.mean(ttfts) * 1e3:.0f} ms, median "
              f"{statistics.median(ttfts) * 1e3:.0f} ms, max {ttfts[-1] * 1e3:.0f} ms")  # fmt: skip
        return 0
    print(f"{args.requests} requests of each kind at idle, {args.max_tokens} tokens each")
    decode_steps = sorted(durations)[: max(1, len(durations) * 9 // 10)]  # prefills are longest
    step = statistics.median(decode_steps) if decode_steps else 0.0
    # Request ids, in the order sent: chat ids start "chatcmpl-", completions "cmpl-".
    by_prefix: dict[str, list[list[tuple[str, float]]]] = {}
    for rid, ev in sorted(events.items(), key=lambda kv: kv[1][0][1]):
        by_prefix.setdefault(rid.split("-")[0], []).append(ev)
    for kind in kinds:
        evs = by_prefix.get("chatcmpl" if kind.startswith("chat") else "cmpl", [])
        mine, evs[:] = evs[: len(runs[kind])], evs[len(runs[kind]) :]
        report(kind, runs[kind], mine, step)
    if between:
        print(f"between steps (scheduler loop outside engine.step) median "
              f"{statistics.median(between) * 1e3:.2f} ms")  # fmt: skip
    return 0


def report(
    kind: str,
    runs: list[tuple[float, list[float], float]],
    events: list[list[tuple[str, float]]],
    step: float,
) -> None:
    """One kind's hops (medians over its requests), TTFT against the prefill step, ITL."""
    per_req = [gaps(ev) for ev in events]
    last = "first_byte" if kind.endswith("-stream") else "replied"
    for g, (_, times, t0), ev in zip(per_req, runs, events):
        first = dict(reversed(ev))
        g["client sent -> received"] = first["received"] - t0
        g[f"{last} -> client got"] = times[0] - first.get(last, times[0])
    print(f"{kind}:")
    for key in per_req[0] if per_req else []:
        vals = [g[key] for g in per_req if key in g]
        print(f"  {key:<28} median {statistics.median(vals) * 1e3:7.2f} ms")
    prefills = [g["scheduled -> forwarded"] for g in per_req if "scheduled -> forwarded" in g]
    prefill = statistics.median(prefills) if prefills else 0.0
    ttft = statistics.median(r[0] for r in runs)
    print(f"  TTFT (client) median {ttft * 1e3:.1f} ms; prefill step {prefill * 1e3:.1f} ms; "
          f"outside the forward: {(ttft - prefill) * 1e3:.1f} ms (target <= 15)")  # fmt: skip
    itl = [b - a for _, times, _ in runs for a, b in zip(times, times[1:])]
    if itl and step:
        med = statistics.median(itl)
        print(f"  ITL (client) median {med * 1e3:.2f} ms; decode step median {step * 1e3:.2f} "
              f"ms; difference {(med - step) * 1e3:.2f} ms (target <= 3)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
