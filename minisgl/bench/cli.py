"""`python -m minisgl.bench`: a serving benchmark with sglang bench_serving's flags.

Works against any OpenAI-compatible server (minisgl, vLLM, SGLang, transformers serve):

    python -m minisgl.bench --base-url http://127.0.0.1:8000 --num-prompts 32 \
        --max-concurrency 8 --random-input-len 128 --random-output-len 64 --output-file r.json
"""

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

import httpx

from minisgl.bench.dataset import random_requests
from minisgl.bench.runner import Target, benchmark, warmup
from minisgl.bench.summary import format_report, summarize

# sglang/vLLM backend names map onto the two OpenAI endpoints.
BACKENDS = {
    "completions": "completions",
    "chat": "chat",
    "openai": "completions",
    "openai-chat": "chat",
    "sglang-oai": "completions",
    "sglang-oai-chat": "chat",
    "vllm": "completions",
    "vllm-chat": "chat",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl.bench", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    p.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    p.add_argument("--backend", default="completions", choices=sorted(BACKENDS),
                   help="completions (/v1/completions) or chat (/v1/chat/completions)")  # fmt: skip
    p.add_argument("--model", default=None, help="model name; default: first of /v1/models")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer.json or model dir: prompts from random token ids; "
                   "without it prompts are random common words (~1 token each)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals; inf sends all at once")  # fmt: skip
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths uniform in [len * ratio, len]; 1.0 gives exact lengths")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it)")  # fmt: skip
    p.add_argument("--extra-request-body", default=None,
                   help='JSON merged into every request, e.g. \'{"top_k": 1}\'')  # fmt: skip
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout (s)")
    p.add_argument("--output-file", default=None, help="write the results as JSON here")
    p.add_argument("--output-details", action="store_true",
                   help="include per-request numbers in the output file")  # fmt: skip
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark the arguments describe; returns what --output-file holds."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or first_model(base_url, args.api_key)
    target = Target(
        base_url=base_url,
        backend=BACKENDS[args.backend],
        model=model,
        api_key=args.api_key,
        ignore_eos=not args.disable_ignore_eos,
        extra_body=json.loads(args.extra_request_body) if args.extra_request_body else {},
        timeout_s=args.timeout,
    )
    requests = random_requests(
        args.num_prompts, args.random_input_len, args.random_output_len,
        args.random_range_ratio, args.seed, args.tokenizer,
    )  # fmt: skip
    if requests and args.warmup_requests > 0:
        warm = asyncio.run(warmup(target, requests[0], args.warmup_requests))
        failed = [r.error for r in warm if not r.success]
        if failed:
            raise SystemExit(f"warmup failed: {failed[0]}")
    results, duration = asyncio.run(
        benchmark(target, requests, args.request_rate, args.max_concurrency, args.seed,
                  progress=not args.disable_tqdm)
    )  # fmt: skip
    summary = summarize(results, duration)
    header = {
        "Backend": target.backend,
        "Model": model,
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency or "unlimited",
        "Prompts": "tokenizer ids" if args.tokenizer else "random words",
    }
    print(format_report(summary, header))
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        print(f"error: {err}", file=sys.stderr)
    record: dict[str, Any] = {
        "backend": target.backend,
        "base_url": base_url,
        "model": model,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "seed": args.seed,
        "prompt_source": "tokenizer" if args.tokenizer else "words",
        **summary,
        "errors": errors,
    }
    if args.output_details:
        record["details"] = [
            {"success": r.success, "error": r.error, "prompt_len": r.prompt_len,
             "output_len": r.output_len, "ttft": r.ttft, "latency": r.latency, "itl": r.itl,
             "finish_reason": r.finish_reason}
            for r in results
        ]  # fmt: skip
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(record, f, indent=2)
    return record


def check_args(args: argparse.Namespace) -> None:
    """ValueError for values that cannot describe a run: they used to pass and end in a
    traceback (--request-rate 0: ZeroDivisionError; --max-concurrency -1: the semaphore's
    ValueError), in a report of nothing with exit code 0 (--num-prompts 0), or quietly as
    something else (--max-concurrency 0: unlimited)."""
    at_least_one = ("num_prompts", "max_concurrency", "random_input_len", "random_output_len")
    for name in at_least_one:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not args.request_rate > 0:  # NaN too
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if args.extra_request_body is not None:
        try:
            body = json.loads(args.extra_request_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-request-body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ValueError("--extra-request-body must be a JSON object")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        record = run(args)
    except httpx.HTTPError as e:  # e.g. nothing listening at --base-url: one line, no traceback
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        print(f"{parser.prog}: error: {base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. --tokenizer names no tokenizer.json
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0 if record["failed"] == 0 else 1
