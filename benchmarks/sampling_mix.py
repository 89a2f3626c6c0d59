"""What penalties and logprobs in part of a batch cost the plain requests beside them.

Two batches of the same prompts decode the same number of tokens (ignore_eos) through the
engine LLM.generate uses: a plain one, and a mixed one where a quarter of the requests ask for
repetition/frequency/presence penalties, a logit_bias and top-5 logprobs. Every request of a
batch runs in the same steps, so the plain requests' decode speed is the batch's: the ratio
of the mixed to the plain decode step time is their slowdown (target: at most 1.05). Runs alternate (plain, mixed,
plain, ...) and the median of each is reported, since other work on the machine adds noise.
Both greedy and sampled (temperature 0.8, top_p 0.95) batches are measured: a mixed batch
keeps the plain rows' sampling path.

    python benchmarks/sampling_mix.py                   # the Qwen3-0.6B-shaped fixture, bf16
    python benchmarks/sampling_mix.py --preset tiny --dtype float32 --batch 16 --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from roofline import cpu_description


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n)]


def batches(n: int, out_len: int, temperature: float) -> tuple[list, list]:
    from minisgl import SamplingParams

    def plain() -> SamplingParams:
        top_p = 0.95 if temperature > 0 else 1.0
        return SamplingParams(
            temperature=temperature, top_p=top_p, seed=1, max_tokens=out_len, ignore_eos=True
        )

    def featured(i: int) -> SamplingParams:
        p = plain()
        p.repetition_penalty = 1.2
        p.frequency_penalty = 0.5
        p.presence_penalty = 0.3
        p.logit_bias = {100 + i: -100.0, 200 + i: 2.0}
        p.logprobs = 5
        return p

    mixed = [featured(i) if i % 4 == 3 else plain() for i in range(n)]
    return [plain() for _ in range(n)], mixed


_ids = iter(range(1 << 62))


def decode_step_time(engine, prompts, params) -> float:
    """Seconds per decode step once every request has its first token (prefill excluded)."""
    rids = [f"bench-{next(_ids)}" for _ in prompts]
    for rid, ids, p in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, ids, p)
    started: set[str] = set()
    t0, steps = 0.0, 0
    while engine.has_unfinished():
        outs = engine.step()
        if len(started) == len(rids):
            steps += 1
        started.update(o.rid for o in outs)
        if len(started) == len(rids) and steps == 0:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / max(1, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: a fixture model written once)")
    ap.add_argument("--preset", default="0.6b", choices=("tiny", "0.6b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat, short outputs")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.out_len = 1, 8

    from minisgl import LLM

    model = args.model
    if model is None:
        from minisgl.testing.fixture import write_fixture_model

        root = Path(tempfile.gettempdir()) / f"minisgl-bench-{args.preset}-{args.dtype}"
        if not (root / "config.json").is_file():
            write_fixture_model(root, preset=args.preset, dtype=args.dtype)
        model = str(root)
    print(f"CPU: {cpu_description()}", flush=True)
    print(
        f"model {model} ({args.preset}), {args.dtype} on {args.device}; batch {args.batch} x "
        f"{args.prompt_len} prompt + {args.out_len} output tokens; a quarter penalised + logprobs",
        flush=True,
    )
    # A KV cache for this batch only (the default takes most of free memory).
    pages = args.batch * (-(-(args.prompt_len + args.out_len) // 16) + 1)
    llm = LLM(
        model, dtype=args.dtype, device=args.device, num_pages=pages, disable_prefix_cache=True
    )
    prompts = make_prompts(args.batch, args.prompt_len, seed=0)
    worst = 0.0
    for temperature in (0.0, 0.8):
        plain, mixed = batches(args.batch, args.out_len, temperature)
        decode_step_time(llm.engine, prompts[:4], mixed[:4])  # warm-up
        t_plain, t_mixed = [], []
        for _ in range(args.repeats):
            t_plain.append(decode_step_time(llm.engine, prompts, plain))
            t_mixed.append(decode_step_time(llm.engine, prompts, mixed))
        p, m = statistics.median(t_plain), statistics.median(t_mixed)
        ratio = m / p
        worst = max(worst, ratio)
        kind = "greedy" if temperature == 0 else f"temperature {temperature}, top_p 0.95"
        print(
            f"{kind:>30}: decode step plain {1000 * p:7.1f} ms ({args.batch / p:6.1f} tok/s), "
            f"mixed {1000 * m:7.1f} ms ({args.batch / m:6.1f} tok/s): plain requests "
            f"{100 * (ratio - 1):+.1f}% slower",
            flush=True,
        )
    verdict = "within" if worst <= 1.05 else "ABOVE"
    print(f"worst slowdown {100 * (worst - 1):+.1f}% ({verdict} the 5% target)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
