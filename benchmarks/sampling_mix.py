"""What penalties and logprobs in part of a batch cost the plain requests beside them.

Two batches of the same prompts decode the same number of tokens (ignore_eos) through the
engine LLM.generate uses: a plain one, and a mixed one where a quarter of the requests ask for
repetition/frequency/presence penalties, a logit_bias and top-5 logprobs. Every request of a
batch runs in the same steps, so the plain requests' decode speed is the batch's: the ratio
of the mixed to the plain decode step time is their slowdown (target: at most 1.05). Runs alternate (plain, mixed,
plain, ...) and the best of each is compared, since other work on the machine only adds time.
The forward pass itself is the same for both batches, so the time each step spends outside it
(sampling, penalties, logprobs, bookkeeping) is also reported: the difference is what the
features cost, free of the forward pass's run-to-run noise.
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


class StepClock:
    """Per decode step: the whole step, and the part of it that is not the model's forward
    pass (sampling, penalties, logprobs, the engine's bookkeeping). The forward pass of a
    mixed batch is the plain one's, so the second isolates what the features cost without the
    run-to-run noise of the forward pass (10-20% on a shared machine)."""

    def __init__(self, engine) -> None:
        self.model_s = 0.0
        runner = engine.runner
        forward, sample = runner.forward, runner._sample

        def timed_forward(inp):
            t0 = time.perf_counter()
            self.inner_s = 0.0
            out = forward(inp)
            self.model_s += time.perf_counter() - t0 - self.inner_s
            return out

        def timed_sample(*a, **k):
            t0 = time.perf_counter()
            out = sample(*a, **k)
            self.inner_s += time.perf_counter() - t0
            return out

        runner.forward, runner._sample = timed_forward, timed_sample
        self.inner_s = 0.0


def decode_step_time(engine, prompts, params, clock: StepClock) -> tuple[float, float]:
    """(seconds per decode step, of which outside the model's forward pass) once every
    request has its first token (prefill excluded)."""
    rids = [f"bench-{next(_ids)}" for _ in prompts]
    for rid, ids, p in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, ids, p)
    started: set[str] = set()
    t0, steps, model0 = 0.0, 0, 0.0
    while engine.has_unfinished():
        outs = engine.step()
        if len(started) == len(rids):
            steps += 1
        started.update(o.rid for o in outs)
        if len(started) == len(rids) and steps == 0:
            t0, model0 = time.perf_counter(), clock.model_s
    total = time.perf_counter() - t0
    return total / max(1, steps), (total - (clock.model_s - model0)) / max(1, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: a fixture model written once)")
    ap.add_argument("--preset", default="0.6b", choices=("tiny", "0.6b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
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
    clock = StepClock(llm.engine)
    worst = worst_extra = 0.0
    for temperature in (0.0, 0.8):
        plain, mixed = batches(args.batch, args.out_len, temperature)
        decode_step_time(llm.engine, prompts[:4], mixed[:4], clock)  # warm-up
        t_plain, t_mixed = [], []
        for _ in range(args.repeats):
            t_plain.append(decode_step_time(llm.engine, prompts, plain, clock))
            t_mixed.append(decode_step_time(llm.engine, prompts, mixed, clock))
        print(f"  runs (ms): plain {[round(1000 * t, 1) for t, _ in t_plain]}, "
              f"mixed {[round(1000 * t, 1) for t, _ in t_mixed]}", flush=True)  # fmt: skip
        # The best run: other work on the machine only ever adds time (bursts of +10-30% seen
        # on an idle VM), so the fastest of each is the cleanest estimate of its cost.
        p = min(t for t, _ in t_plain)
        m = min(t for t, _ in t_mixed)
        # Outside the forward pass: the features' own cost per step, as a share of the step.
        op = statistics.median(o for _, o in t_plain)
        om = statistics.median(o for _, o in t_mixed)
        ratio, extra = m / p, (om - op) / p
        worst, worst_extra = max(worst, ratio), max(worst_extra, extra)
        kind = "greedy" if temperature == 0 else f"temperature {temperature}, top_p 0.95"
        print(
            f"{kind:>30}: best decode step plain {1000 * p:7.1f} ms ({args.batch / p:6.1f} tok/s), "
            f"mixed {1000 * m:7.1f} ms ({args.batch / m:6.1f} tok/s): plain requests "
            f"{100 * (ratio - 1):+.1f}% slower; outside the forward pass plain "
            f"{1000 * op:.2f} ms, mixed {1000 * om:.2f} ms = {100 * extra:+.1f}% of a step",
            flush=True,
        )
    verdict = "within" if worst <= 1.05 else "ABOVE"
    print(f"worst slowdown {100 * (worst - 1):+.1f}% ({verdict} the 5% target); the features' "
          f"own work at most {100 * worst_extra:+.1f}% of a step", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
