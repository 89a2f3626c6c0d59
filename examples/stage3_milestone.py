"""Stage 3 milestone: the multi-process OpenAI server, end to end.

    python examples/stage3_milestone.py                 # offline: a random tiny fixture model
    python examples/stage3_milestone.py --model DIR     # a real Qwen3 checkpoint (or hub id)
    python examples/stage3_milestone.py --preset 0.6b   # random Qwen3-0.6B-shaped weights
    python examples/stage3_milestone.py --keep-serving  # then keep serving until Ctrl-C

Starts `python -m minisgl`, counts its worker processes, sends one non-streaming and one
streaming chat (time to first chunk), then 8 concurrent requests x 16 tokens (ignore_eos), and
prints a curl line to try by hand (and the playground's address) before it stops the server,
or, with --keep-serving, once Ctrl-C is pressed. A fixture model it wrote is removed at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> dict[int, str]:
    """Child pids with their process title (Linux /proc)."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out[int(child)] = cmd
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit("server not ready in time")


async def concurrent(url: str, model: str, n: int, tokens: int) -> tuple[float, list[float]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> float:
        start = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: count to ten.", max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - start
        return first or float("nan")

    start = time.perf_counter()
    ttfts = await asyncio.gather(*[one(i) for i in range(n)])
    return time.perf_counter() - start, list(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model dir or hub id (default: write a random fixture)")
    ap.add_argument("--preset", default="tiny", help="fixture preset when --model is not given")
    ap.add_argument("--dtype", default=None, help="default: float32 for the fixture, else auto")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--keep-serving", action="store_true", help="keep the server up until Ctrl-C")
    args = ap.parse_args()

    scratch = None if args.model else Path(tempfile.mkdtemp(prefix="minisgl-stage3-"))
    try:
        run(args, scratch)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            print(f"removed the fixture model in {scratch}")


def run(args: argparse.Namespace, scratch: Path | None) -> None:
    model = args.model
    if scratch is not None:
        from minisgl.testing.fixture import write_fixture_model

        model = str(write_fixture_model(scratch / "qwen3", args.preset))
        print(f"wrote a random {args.preset} Qwen3 fixture to {model}")
    dtype = args.dtype or ("float32" if args.model is None else "auto")
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--dtype", dtype,
           "--port", str(port), "--max-seq-len-override", "2048"]  # fmt: skip
    print("$", " ".join(cmd))
    t0 = time.perf_counter()
    # A session of its own: Ctrl-C reaches this script only, which then stops the server once.
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_ready(url, proc)
        print(f"\nready in {time.perf_counter() - t0:.1f} s")
        kids = children(proc.pid)
        # spawn also starts multiprocessing's resource tracker: a helper, not a worker.
        workers = [p for p, cmd in kids.items() if "resource_tracker" not in cmd]
        print(f"server pid {proc.pid}: {len(workers)} worker processes {workers} "
              f"(+{len(kids) - len(workers)} multiprocessing helper)")  # fmt: skip

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        msgs: Any = [{"role": "user", "content": "Give me three facts about the moon."}]
        start = time.perf_counter()
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=32)
        print(f"\nnon-stream ({time.perf_counter() - start:.2f} s, {r.usage}):")
        print("  ", repr(r.choices[0].message.content))

        start = time.perf_counter()
        first = None
        print("stream:\n   ", end="")
        stream = client.chat.completions.create(
            model=name,
            messages=msgs,
            max_tokens=32,
            stream=True,  # type: ignore[arg-type]
        )
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                first = first or time.perf_counter() - start
                print(text, end="", flush=True)
        print(f"\n  time to first chunk: {1000 * (first or 0):.0f} ms")

        n, tokens = 8, 16
        elapsed, ttfts = asyncio.run(concurrent(url, name, n, tokens))
        ttfts.sort()
        print(f"\n{n} concurrent x {tokens} tokens: {elapsed:.2f} s, "
              f"{n * tokens / elapsed:.1f} tokens/s, TTFT median {1000 * ttfts[n // 2]:.0f} ms, "
              f"max {1000 * ttfts[-1]:.0f} ms")  # fmt: skip
        print("\ntry it:")
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")  # fmt: skip
        print(f"  or open the playground: {url}/")
        if args.keep_serving:
            print(f"\nserving at {url} until Ctrl-C", flush=True)
            try:
                proc.wait()
            except KeyboardInterrupt:
                print("\nCtrl-C: stopping the server")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        print(f"\nserver exited with code {code}")


if __name__ == "__main__":
    main()
