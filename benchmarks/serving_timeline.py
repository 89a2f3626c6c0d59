"""Where a streamed request's time goes outside the forward pass (the per-request timeline).

Starts `python -m minisgl` with MINISGL_TIMELINE set (see minisgl/timeline.py) on the random
Qwen3-0.6B-shaped model, sends --requests streamed completions one at a time at idle (a short
prompt, --max-tokens tokens each, ignore_eos), and prints for the median request:
- each hop from HTTP received to the first byte written, and TTFT minus the prefill forward;
- the inter-token latency at the client against the decode step the scheduler measured.
Targets (issue 12): TTFT at idle <= one prefill forward + 15 ms; ITL <= one decode step + 3 ms.

    python benchmarks/serving_timeline.py [--model DIR] [--requests 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from minisgl import timeline
from minisgl.layers.cpu_build import cpu_info

PROMPT = "The quick brown fox jumps"  # a handful of tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_one(
    client: httpx.Client, base: str, max_tokens: int
) -> tuple[float, list[float], float]:
    """(seconds to the first content chunk, wall-clock arrival times of every content chunk,
    wall-clock send time). One client for every request, as an application's OpenAI client:
    a new httpx client per request costs ~30 ms of its own set-up (SSL context) before it
    sends anything, which the timeline would count as the server's."""
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    times: list[float] = []
    t0 = time.time()
    with client.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                times.append(time.time())
    return times[0] - t0, times, t0


def gaps(events: list[tuple[str, float]]) -> dict[str, float]:
    first = {}
    for stage, t in events:
        first.setdefault(stage, t)
    out = {}
    for a, b in zip(timeline.STAGES, timeline.STAGES[1:]):
        if a in first and b in first:
            out[f"{a} -> {b}"] = first[b] - first[a]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model dir (default: the random 0.6B fixture, bf16)")
    ap.add_argument("--fixture-dir", default="/tmp/minisgl-bench-models")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--extra", default="", help="more server flags, space-separated")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from minisgl.testing.fixture import write_fixture_model

        model = Path(args.fixture_dir) / "qwen3-0.6b-bfloat16"
        if not (model / "config.json").is_file():
            write_fixture_model(model, preset="0.6b", dtype="bfloat16")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
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
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(1)
                if proc.poll() is not None:
                    print(Path(tmp, "server.log").read_text()[-3000:])
                    return 1
            client = httpx.Client()
            stream_one(client, base, 4)  # warm-up (and the connection opened)
            Path(tl).write_text("")
            client_ttft, client_itl, sent, got = [], [], [], []
            for _ in range(args.requests):
                ttft, times, t0 = stream_one(client, base, args.max_tokens)
                client_ttft.append(ttft)
                sent.append(t0)
                got.append(times[0])
                client_itl += [b - a for a, b in zip(times, times[1:])]
                time.sleep(0.3)  # idle between requests
            events = timeline.read(tl)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    steps = events.pop("-", [])
    durations = [
        b[1] - a[1] for a, b in zip(steps, steps[1:]) if a[0] == "step_begin" and b[0] == "step_end"
    ]
    between = [
        b[1] - a[1]
        for a, b in zip(steps, steps[1:])
        if a[0] == "step_end" and b[0] == "step_begin" and b[1] - a[1] < 0.25
    ]
    per_req = [gaps(ev) for ev in events.values()]
    for g, t0, t1, ev in zip(per_req, sent, got, events.values()):
        first = dict(reversed(ev))
        g["client sent -> received"] = first["received"] - t0
        g["first_byte -> client got"] = t1 - first.get("first_byte", t1)
    name, flags = cpu_info()
    noted = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    print(f"CPU: {name} [{noted}], {os.cpu_count()} cores")
    print(f"{len(per_req)} requests at idle, prompt {PROMPT!r}, {args.max_tokens} tokens each")
    for key in per_req[0] if per_req else []:
        vals = [g[key] for g in per_req if key in g]
        print(f"  {key:<28} median {statistics.median(vals) * 1e3:7.2f} ms")
    prefill = statistics.median(
        [g["scheduled -> forwarded"] for g in per_req if "scheduled -> forwarded" in g]
    )
    ttft = statistics.median(client_ttft)
    decode_steps = sorted(durations)[: max(1, len(durations) * 9 // 10)]  # prefills are longest
    step = statistics.median(decode_steps)
    itl = statistics.median(client_itl)
    print(f"TTFT (client) median {ttft * 1e3:.1f} ms; prefill step {prefill * 1e3:.1f} ms; "
          f"outside the forward: {(ttft - prefill) * 1e3:.1f} ms (target <= 15)")  # fmt: skip
    if between:
        print(f"between steps (scheduler loop outside engine.step) median "
              f"{statistics.median(between) * 1e3:.2f} ms")  # fmt: skip
    print(f"ITL (client) median {itl * 1e3:.2f} ms; decode step median {step * 1e3:.2f} ms; "
          f"difference {(itl - step) * 1e3:.2f} ms (target <= 3)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
