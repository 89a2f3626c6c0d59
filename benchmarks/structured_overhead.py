"""What constrained requests cost the plain requests that share their batch.

A batch of --batch requests decodes --output-len tokens each (ignore_eos), once all plain, once
with a quarter of them constrained by a JSON schema (an array of objects with bounded integers,
enums and booleans, long enough that no constrained request ends early, so both batches keep
the same size throughout). Both runs alternate --repeats times in one process; the report is the
plain requests' tokens/s in each (best of the repeats: other work on the machine only ever slows a run down) and their ratio. Target: the plain requests no more
than 5% slower. Uses the random Qwen3-0.6B-shaped fixture model (or --model PATH).

    python benchmarks/structured_overhead.py                      # 0.6B bf16, batch 16 x 64
    python benchmarks/structured_overhead.py --quick              # tiny model smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from roofline import cpu_description

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
        "additionalProperties": False,
    },
    "minItems": 500,  # never closed within the run: the batch keeps its size
}


def log(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model dir (default: write the random fixture)")
    ap.add_argument("--preset", default="0.6b", choices=("tiny", "0.6b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 x 16 tokens, 2 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.dtype, args.batch, args.output_len, args.repeats = (
            "tiny", "float32", 8, 16, 2,
        )  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)

    from minisgl import LLM, SamplingParams
    from minisgl.testing.fixture import write_fixture_model

    tmp = tempfile.TemporaryDirectory(prefix="minisgl-bench-")
    model = args.model
    if model is None:
        log(f"writing a random Qwen3-{args.preset} checkpoint ({args.dtype}) ...")
        model = str(write_fixture_model(Path(tmp.name), preset=args.preset, dtype=args.dtype))
    # KV for the whole batch and no more (the default would take most of the free memory).
    pages = args.batch * (128 + args.output_len + 16) // 16 + 64
    llm = LLM(model, dtype=args.dtype, device=args.device, max_seq_len=1024, num_pages=pages)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 151643) for _ in range(rng.randint(64, 128))] for _ in range(args.batch)]  # fmt: skip
    n_constrained = max(1, args.batch // 4)
    plain = SamplingParams(temperature=1.0, seed=1, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=1.0,
        seed=2,
        max_tokens=args.output_len,
        grammar_kind="json_schema",
        grammar=json.dumps(SCHEMA),
    )
    mixed = [constrained] * n_constrained + [plain] * (args.batch - n_constrained)
    # Warm-up: kernels, xgrammar's set-up and the schema's compilation (cached from then on).
    t0 = time.perf_counter()
    llm.generate(prompts[:2], [plain, constrained])
    log(
        f"warm-up (incl. xgrammar set-up and the schema's compilation): {time.perf_counter() - t0:.1f} s"
    )

    grammar_s = [0.0]  # time in the grammar work of the steps (fill, mask, advance)
    steps = [0]

    def timed(fn):  # noqa: ANN001, ANN202 - a benchmark's instrumentation
        def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                grammar_s[0] += time.perf_counter() - t

        return wrapper

    import minisgl.engine.model_runner as model_runner

    engine = llm.engine
    engine._grammar_bitmask = timed(engine._grammar_bitmask)  # type: ignore[method-assign]
    engine._advance_grammars = timed(engine._advance_grammars)  # type: ignore[method-assign]
    model_runner.apply_grammar_mask = timed(model_runner.apply_grammar_mask)
    step = engine.step

    def counted_step():  # noqa: ANN202
        steps[0] += 1
        return step()

    engine.step = counted_step  # type: ignore[method-assign]

    def run(params: list[SamplingParams]) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.token_ids) == args.output_len for o in outs), "a request ended early"
        return elapsed

    plain_s, mixed_s = [], []
    for i in range(args.repeats):
        plain_s.append(run([plain] * args.batch))
        grammar_s[0], steps[0] = 0.0, 0
        mixed_s.append(run(mixed))
        grammar_ms, mixed_steps = 1e3 * grammar_s[0] / steps[0], steps[0]
        log(f"repeat {i + 1}: plain batch {plain_s[-1]:.2f} s, mixed batch {mixed_s[-1]:.2f} s")
    n_plain_mixed = args.batch - n_constrained
    plain_tps = args.batch * args.output_len / min(plain_s)
    mixed_tps = n_plain_mixed * args.output_len / min(mixed_s)
    per_request_plain = plain_tps / args.batch
    per_request_mixed = mixed_tps / n_plain_mixed
    slower = per_request_plain / per_request_mixed - 1
    log("")
    log(f"CPU: {cpu_description()}")
    log(
        f"model {args.preset} {args.dtype} on {args.device}; batch {args.batch} x "
        f"{args.output_len} tokens; {n_constrained} of them constrained (JSON schema)"
    )
    log(f"plain batch : {plain_tps:8.1f} tok/s, {per_request_plain:.2f} tok/s per request")
    log(
        f"mixed batch : {mixed_tps:8.1f} tok/s from its {n_plain_mixed} plain requests, "
        f"{per_request_mixed:.2f} tok/s per plain request"
    )
    log(f"plain requests are {100 * slower:+.1f}% slower in the mixed batch (target <= +5%)")
    step_ms = 1e3 * min(mixed_s) / mixed_steps
    log(
        f"grammar work per step of the mixed batch (bitmask fill, masking kernel, matcher "
        f"advance): {grammar_ms:.2f} ms of a {step_ms:.1f} ms step ({100 * grammar_ms / step_ms:.1f}%)"
    )
    llm.shutdown()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
