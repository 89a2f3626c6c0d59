"""Aggregate numbers of a benchmark run, named as sglang's bench_serving names them."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from minisgl.bench.client import RequestResult


def _stats(prefix: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/median/p99 (and std/p90/p95) in milliseconds; None when nothing was measured."""
    keys = ("mean", "median", "std", "p90", "p95", "p99")
    if not values_s:
        return {f"{k}_{prefix}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    vals = (
        ms.mean(), np.median(ms), ms.std(),
        np.percentile(ms, 90), np.percentile(ms, 95), np.percentile(ms, 99),
    )  # fmt: skip
    return {f"{k}_{prefix}_ms": float(v) for k, v in zip(keys, vals, strict=True)}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    # TPOT excludes the first token, as in sglang/vLLM: (E2E - TTFT) / (tokens - 1).
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    duration = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        # Average number of requests in flight over the run.
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    out |= _stats("ttft", [r.ttft for r in ok])
    out |= _stats("tpot", tpots)
    out |= _stats("itl", itls)
    out |= _stats("e2e_latency", [r.latency for r in ok])
    return out


def format_report(summary: dict[str, Any], header: dict[str, Any]) -> str:
    """The console table, in bench_serving's layout."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        if value is None:
            text = "n/a"
        elif isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        lines.append(f"{label + ':':<40} {text:<10}")

    for label, value in header.items():
        row(label, value)
    row("Successful requests", summary["completed"])
    row("Failed requests", summary["failed"])
    row("Benchmark duration (s)", summary["duration"])
    row("Total input tokens", summary["total_input_tokens"])
    row("Total generated tokens", summary["total_output_tokens"])
    row("Request throughput (req/s)", summary["request_throughput"])
    row("Input token throughput (tok/s)", summary["input_throughput"])
    row("Output token throughput (tok/s)", summary["output_throughput"])
    row("Total token throughput (tok/s)", summary["total_throughput"])
    row("Concurrency", summary["concurrency"])
    for key, title in (
        ("e2e_latency", "End-to-End Latency"),
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        lines.append(title.center(width, "-"))
        short = "E2E Latency" if key == "e2e_latency" else key.upper()
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize()} {short} (ms)", summary[f"{stat}_{key}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)
