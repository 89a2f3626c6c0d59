"""Speculative decoding (ngram): decode tokens/s with and without it, same run, same model.

The model is the random checkpoint of --model-shape (Qwen3-0.6B, bf16 by default; its LM head
untied, see untied_fixture) with every attention output projection zeroed: each position's logits then depend on its own token only
(a bigram model; the step costs what the real shape's step costs, zeros multiply as fast as
anything), so the model's greedy continuation of a start token s is a fixed sequence C(s), and
a prompt can be built to be copied or not:

- copy: random filler, then "s C(s)" (the model's own output, fed back inside the prompt), more
  filler, then s: the model writes C(s) again, and ngram drafts copied from the prompt are kept;
- nothing to accept: random filler, then each token of C(s) followed by a random one, then s:
  every step, the last token occurred earlier in the prompt, so ngram drafts what followed it
  there (a random token), and the model never agrees. The adaptive controller has to notice.

Each workload runs as 1 stream and as --streams concurrent streams, on two engines loaded side
by side (speculation off / on), repeats alternating between them; decode tokens/s (the first
step, which prefills, left out), the acceptance rate (drafts kept / drafts verified), the mean
drafts kept per verify and tokens per step. Greedy outputs are checked equal.

    python benchmarks/spec_decode.py                          # full size, a few minutes
    python benchmarks/spec_decode.py --num-layers 4 --output-len 64 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench_models import MODEL_SHAPES
from roofline import cpu_description

VOCAB_FILLER = 150000  # random filler tokens are drawn below this (plain text ids)


def untied_fixture(shape: str, dtype: str, root: Path, num_layers: int | None) -> Path:
    """The random checkpoint of `shape` with its own LM head: with random weights a head tied to
    the embedding makes each token its own most likely successor (the residual stream is mostly
    its embedding), and every continuation one repeated token. A step reads the same bytes
    either way (the head; the embedding table is only looked up)."""
    from minisgl.testing.fixture import PRESETS, write_fixture_model

    preset = MODEL_SHAPES[shape]
    layers = num_layers or PRESETS[preset].num_hidden_layers
    out = root / f"{shape}-{layers}l-{dtype}-untied"
    if not (out / "config.json").is_file():
        write_fixture_model(
            out, preset, dtype=dtype, num_hidden_layers=layers, tie_word_embeddings=False
        )
    return out


@dataclass
class Run:
    seconds: float  # decode: from the end of the first (prefill) step to the last token
    tokens: int  # decode tokens (each stream's output less its first token)
    steps: int  # decode steps
    drafted: int
    kept: int
    verifies: int  # request-steps that verified drafts
    outputs: list[list[int]]
    # The controller's costs at the end (spec only): a step of every stream verifying K drafts
    # over a plain step of them, as it measured them (speculative/adaptive.py).
    verify_cost: float | None = None


def run(llm, prompts: list[list[int]], out_len: int) -> Run:  # noqa: ANN001
    from minisgl import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    outs: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    drafted = kept = verifies = steps = 0
    start = None
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.rid] += o.new_token_ids
            drafted += o.spec_draft_tokens
            kept += o.spec_accepted_tokens
            verifies += o.spec_draft_tokens > 0
        if start is None:  # the first step prefilled every prompt (one chunk each)
            start = time.perf_counter()
            continue
        steps += 1
    assert start is not None
    seconds = time.perf_counter() - start
    tokens = sum(len(v) - 1 for v in outs.values())
    verify_cost = None
    if engine.adaptive is not None:
        n, k = len(prompts), engine.args.speculative_num_draft_tokens
        cost = engine.adaptive.cost
        verify_cost = cost.seconds(n * (k + 1), True) / cost.seconds(n, False)
    outputs = [outs[k] for k in sorted(outs)]
    return Run(seconds, tokens, steps, drafted, kept, verifies, outputs, verify_cost)


def workloads(llm, starts: list[int], out_len: int, seed: int) -> dict[str, list[list[int]]]:  # noqa: ANN001
    """Per workload, one prompt per start token (see the module doc)."""
    from minisgl import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    chains = [o.token_ids for o in llm.generate([[s] for s in starts], params)]
    rng = random.Random(seed)

    def filler(n: int) -> list[int]:
        return [rng.randrange(VOCAB_FILLER) for _ in range(n)]

    copy, nothing = [], []
    for s, chain in zip(starts, chains, strict=True):
        copy.append(filler(32) + [s, *chain] + filler(8) + [s])
        mixed = [t for c in chain for t in (c, rng.randrange(VOCAB_FILLER))]
        nothing.append(filler(32) + mixed + [s])
    return {"copy": copy, "nothing to accept": nothing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--fixture-dir", default="/tmp/minisgl-bench-models")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers (shape's default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8, help="the concurrent case")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpu-kernel-tuning", default="cached", choices=("cached", "full", "off"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from minisgl import LLM

    root = Path(args.fixture_dir)
    from minisgl.testing.copy_model import write_copy_model

    src = untied_fixture(args.model_shape, args.dtype, root, args.num_layers)
    model = write_copy_model(src, src.with_name(src.name + "-bigram"))
    per_stream = 3 * args.output_len + 64  # the longest prompt and its output
    common = dict(
        dtype=args.dtype,
        device="cpu",
        max_seq_len=per_stream + 64,
        num_pages=args.streams * (per_stream // 16 + 2) + 16,  # both engines resident: sized
        cpu_kernel_tuning=args.cpu_kernel_tuning,
    )
    plain = LLM(str(model), **common)
    spec = LLM(
        str(model),
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=args.num_draft_tokens,
        **common,
    )
    rng = random.Random(args.seed)
    starts = [rng.randrange(VOCAB_FILLER) for _ in range(args.streams)]
    loads = workloads(plain, starts, args.output_len, args.seed)

    print(cpu_description())
    print(
        f"model: {args.model_shape} shape, random weights, attention output zeroed (a bigram "
        f"model), {args.dtype}, {args.num_layers or 'all'} layers; ngram, K = "
        f"{args.num_draft_tokens}; {args.output_len} tokens per stream, greedy; "
        f"{args.repeats} repeats, alternating, median"
    )
    cases = [(name, n) for name in loads for n in (1, args.streams)]
    for name, n in cases:  # warm-up: kernels, caches, the controller's step-cost fit
        run(plain, loads[name][:n], 8)
        run(spec, loads[name][:n], 8)
    results: dict[tuple[str, int, str], list[Run]] = {}
    for _ in range(args.repeats):
        for name, n in cases:
            for label, llm in (("plain", plain), ("spec", spec)):
                results.setdefault((name, n, label), []).append(
                    run(llm, loads[name][:n], args.output_len)
                )

    print(
        f"\n{'workload':<18} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} "
        f"{'ratio':>6} {'accept':>7} {'kept/verify':>11} {'tok/step':>8} {'drafts/step':>11} "
        f"{'same output':>11} {'verify cost':>11}"
    )
    for name, n in cases:
        p_runs, s_runs = results[(name, n, "plain")], results[(name, n, "spec")]
        # In float32 greedy outputs are equal token for token (tests/engine); in bfloat16 a
        # verify step's matmuls have other row counts than a plain step's, so near-ties of a
        # random model may break the other way: counted, not asserted.
        same = sum(
            x == y
            for a, b in zip(p_runs, s_runs, strict=True)
            for x, y in zip(a.outputs, b.outputs, strict=True)
        )
        p_rate = statistics.median(r.tokens / r.seconds for r in p_runs)
        s_rate = statistics.median(r.tokens / r.seconds for r in s_runs)
        s = s_runs[-1]
        accept = s.kept / s.drafted if s.drafted else 0.0
        per_verify = s.kept / s.verifies if s.verifies else 0.0
        per_step = s.tokens / s.steps / n if s.steps else 0.0
        print(
            f"{name:<18} {n:>7} {p_rate:>11.2f} {s_rate:>10.2f} {s_rate / p_rate:>6.2f} "
            f"{accept:>7.2f} {per_verify:>11.2f} {per_step:>8.2f} "
            f"{s.drafted / s.steps if s.steps else 0.0:>11.2f} {f'{same}/{n * len(p_runs)}':>11} "
            f"{s.verify_cost or 0.0:>10.2f}x"
        )
    print(
        "accept: drafts kept / drafts verified; kept/verify: drafts kept per request and "
        "verify step (+1 own token = vLLM's and SGLang's acceptance length); tok/step: decode "
        "tokens per stream and step; drafts/step: drafts verified per decode step (all "
        "streams); same output: streams whose greedy tokens equal plain decoding's; verify "
        "cost: what the controller measured a step of every stream verifying K drafts to cost, "
        "over a plain step of them (drafts pay only where it is below 1 + K x acceptance)"
    )
    plain.shutdown()
    spec.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
