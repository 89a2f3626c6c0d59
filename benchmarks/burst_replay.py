"""Replay the scheduler on a burst against a measured step-cost curve (no model, no torch).

The real `Scheduler` and `PrefillBudget` schedule N prompts sent at once; each step costs what
the curve says for its rows (prompt tokens + decodes: piecewise linear between the measured
points, plus a fixed serving cost per step), and the budget learns from those costs as the
engine learns from its timings. Prints TTFT mean/median and output throughput per
--prefill-chunk-overhead, so the trade-off can be read off a machine's own step costs (e.g.
from `decode_step.py`) without a serving run, where a shared machine makes those too noisy.

    python benchmarks/burst_replay.py                      # the quiet 2-core Xeon's costs
    python benchmarks/burst_replay.py --curve 1:56,8:98,32:182,512:1300 --bursts 8x16
"""

from __future__ import annotations

import argparse
import bisect
import statistics

from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import Request, Scheduler
from minisgl.scheduler.prefill_budget import PrefillBudget

# A quiet 2-core Intel Xeon (Sapphire Rapids; avx512f/bf16, amx_bf16), bf16 Qwen3-0.6B shape,
# decode_step.py (docs/performance.md): rows -> ms of one step.
XEON = "1:52.3,8:60.3,32:84.3,512:402,3840:2565"


def parse_curve(text: str) -> list[tuple[int, float]]:
    pts = sorted((int(r), float(ms)) for r, ms in (p.split(":") for p in text.split(",")))
    if len(pts) < 2:
        raise ValueError("a curve needs two points or more")
    return pts


def step_ms(rows: int, curve: list[tuple[int, float]], serve_ms: float) -> float:
    """The curve at `rows`, linear between points and beyond the last two."""
    xs = [x for x, _ in curve]
    i = max(1, min(len(xs) - 1, bisect.bisect_left(xs, rows)))
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (rows - x0) / (x1 - x0) + serve_ms


def replay(
    n: int,
    out: int,
    overhead: float,
    curve: list[tuple[int, float]],
    *,
    prompt_len: int = 128,
    serve_ms: float = 0.0,
    max_prefill_tokens: int = 4096,
) -> tuple[list[float], float]:
    """Each request's TTFT (ms, in arrival order) and the burst's duration (ms)."""
    pages = -(-n * (prompt_len + out) // 16) + n + 1
    s = Scheduler(
        num_pages=pages,
        page_size=16,
        max_running_requests=max(n, 1),
        max_prefill_tokens=max_prefill_tokens,
        max_seq_len=prompt_len + out + 1,
        eos_token_ids=[0],
    )
    budget = PrefillBudget(max_prefill_tokens, 16, overhead) if overhead > 0 else None
    if budget is not None:  # the benchmark's warm-up: lone requests, one at a time
        for _ in range(2):
            budget.observe(prompt_len, 0, step_ms(prompt_len, curve, serve_ms) / 1e3)
            for _ in range(out - 1):
                budget.observe(0, 1, step_ms(1, curve, serve_ms) / 1e3)
        s.soft_prefill_tokens = budget.tokens()
    reqs = [
        Request(
            f"r{i}", [1000 * (i + 1) + j for j in range(prompt_len)], SamplingParams(max_tokens=out)
        )
        for i in range(n)
    ]
    for r in reqs:
        s.add_request(r)
    t = 0.0
    first: dict[str, float] = {}
    while (batch := s.schedule()) is not None:
        dt = step_ms(batch.num_tokens, curve, serve_ms)
        t += dt
        for seq in batch.seqs:
            if seq.sample:
                first.setdefault(seq.req.rid, t)
        s.process_batch_output(batch, [7] * batch.num_samples)
        if budget is not None:
            prefill = batch.num_prefill_tokens
            budget.observe(prefill, batch.num_tokens - prefill, dt / 1e3)
            s.soft_prefill_tokens = budget.tokens()
    return [first[r.rid] for r in reqs], t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--curve", default=XEON, help="rows:ms of one step, comma-separated")
    ap.add_argument("--serve-ms", type=float, default=13.0,
                    help="serving cost per step beyond the forward (quiet Xeon: ~13 ms)")  # fmt: skip
    ap.add_argument("--bursts", default="8x16,32x64", help="NxOUT: N prompts, OUT tokens each")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--overheads", default="0,0.05,0.1,0.25")
    args = ap.parse_args()
    curve = parse_curve(args.curve)
    for spec in args.bursts.split(","):
        n, out = (int(v) for v in spec.split("x"))
        base: tuple[float, float, float] | None = None
        for ov in (float(v) for v in args.overheads.split(",")):
            ttfts, ms = replay(
                n, out, ov, curve, prompt_len=args.prompt_len, serve_ms=args.serve_ms
            )
            row = (statistics.mean(ttfts), statistics.median(ttfts), n * out / ms * 1e3)
            base = base or row
            print(f"{n} x {out}, overhead {ov:4}: TTFT mean {row[0]:6.0f} ms "
                  f"({row[0] / base[0]:.2f}x), median {row[1]:6.0f} ms ({row[1] / base[1]:.2f}x), "
                  f"{row[2]:6.1f} tok/s ({row[2] / base[2]:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
