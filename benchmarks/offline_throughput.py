"""Offline throughput: minisgl's LLM.generate against transformers' generate, same run, same model.

Workloads (issue 2): 64 requests of 128-512 random prompt tokens and 128 output tokens
(ignore_eos) through LLM.generate versus transformers' generate with a padded static batch (the
best of --hf-batch-sizes), and single-stream decode tokens/s for both. Uses a random fixture
model of --model-shape (Qwen3-0.6B by default; Qwen3-30B-A3B with --num-layers to fit memory),
or --model PATH, on CPU by default.

    python benchmarks/offline_throughput.py                  # fp32 and bf16, full size
    python benchmarks/offline_throughput.py --quick          # a small smoke run
    python benchmarks/offline_throughput.py --model-shape qwen3-30b-a3b --num-layers 4 \
        --dtypes bfloat16 --hf-requests bfloat16=16 --hf-batch-sizes 16
    python benchmarks/offline_throughput.py --dtypes bfloat16 --quantization none,int8,int4 \
        --no-transformers    # quantized at load against the float model, same workload

With --quantization each format runs the same workload on the same float checkpoint (quantized
at load) and the table adds its throughput over the float model's from the same run;
transformers runs the float model only (it has none of these formats).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_models import MODEL_SHAPES
from bench_models import fixture as shape_fixture


def log(msg: str) -> None:
    print(msg, flush=True)


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_minisgl(
    model: str, dtype: str, device: str, prompts, out_len: int, quantization: str | None = None
) -> tuple[float, float]:
    """`quantization`: a --quantization format, with a /x8 suffix for
    --cpu-quantized-activations int8 and an @KV suffix for --kv-cache-dtype KV."""
    from minisgl import LLM, SamplingParams

    quantization, _, kv_cache = (quantization or "").partition("@")
    x8 = quantization.endswith("/x8")
    weights = quantization.removesuffix("/x8")
    llm = LLM(
        model,
        dtype=dtype,
        device=device,
        max_seq_len=2048,
        quantization=weights if weights not in ("", "none") else None,
        cpu_quantized_activations="int8" if x8 else "int16",
        kv_cache_dtype=kv_cache or "auto",
    )
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    batch_s = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_len for o in outs)
    single = _single_stream(
        lambda n: llm.generate(
            [prompts[0][:32]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
    )
    llm.shutdown()
    llm = outs = None  # type: ignore[assignment]
    gc.collect()  # the KV pool goes before the peer loads (both must fit in RAM)
    return len(prompts) * out_len / batch_s, single


def run_transformers(
    model: str, dtype: str, device: str, prompts, out_len: int, batch_sizes: list[int]
) -> tuple[float, float, int]:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    hf = loaded.to(device).eval()  # type: ignore[arg-type]  # transformers' .to stub

    def generate(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as generation needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + n

    generate([prompts[0][:16]], 4)  # warm-up
    best, best_bs = 0.0, batch_sizes[0]
    for bs in batch_sizes:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), bs):
            generate(prompts[i : i + bs], out_len)
            log(f"  transformers bs={bs}: {min(i + bs, len(prompts))}/{len(prompts)} requests")
        tps = len(prompts) * out_len / (time.perf_counter() - t0)
        log(f"  transformers bs={bs}: {tps:.1f} tok/s")
        if tps > best:
            best, best_bs = tps, bs
    single = _single_stream(lambda n: generate([prompts[0][:32]], n))
    return best, single, best_bs


def _single_stream(run, short: int = 8, long: int = 72, repeats: int = 3) -> float:
    """Decode tokens/s with prefill cancelled out: (long - short) tokens over the difference of
    the two runs' best times (interleaved repeats: one pair, with the short run held up by other
    work, gave a difference near zero and 6.4e10 tok/s); NaN where the difference is not
    positive."""
    best = {short: float("inf"), long: float("inf")}
    for _ in range(repeats):
        for n in (short, long):
            t0 = time.perf_counter()
            run(n)
            best[n] = min(best[n], time.perf_counter() - t0)
    diff = best[long] - best[short]
    return (long - short) / diff if diff > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model dir or hub id (default: a random --model-shape model)")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers (shape's default)")
    ap.add_argument("--fixture-dir", default=None, help="keep written models here (default: tmp)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=128)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument(
        "--hf-requests",
        default="",
        help="per dtype, e.g. bfloat16=16: time transformers on only the first N requests (whole "
        "static batches; its tokens/s over them estimates all of them, batches being "
        "independent) where the full run would take hours",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 requests x 16 tokens, tiny model")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both (0: default)")
    ap.add_argument(
        "--quantization",
        default="none",
        help="comma-separated --quantization formats for minisgl (int8, int4, fp8; none: the "
        "float model), each run on the same workload; a /x8 suffix adds "
        "--cpu-quantized-activations int8 (e.g. none,int4,int4/x8), an @KV suffix "
        "--kv-cache-dtype KV (e.g. none,none@fp8,int4@fp8)",
    )
    ap.add_argument(
        "--no-transformers", action="store_true", help="minisgl only (no transformers peer)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_requests, args.output_len, args.max_input = 8, 16, 160
        args.hf_batch_sizes = "8"

    from minisgl.testing.fixture import write_fixture_model

    model = args.model
    tmp = tempfile.TemporaryDirectory(prefix="minisgl-bench-")
    root = Path(args.fixture_dir or tmp.name)
    prompts = make_prompts(args.num_requests, args.min_input, args.max_input, args.seed)
    hf_limits = {k: int(v) for k, v in (kv.split("=") for kv in args.hf_requests.split(",") if kv)}
    rows = []
    quant_rows: list[tuple[str, float, float, str, float | None]] = []
    for dtype in args.dtypes.split(","):
        if args.model is None and args.quick:
            model = str(write_fixture_model(root / f"tiny-{dtype}", preset="tiny", dtype=dtype))
        elif args.model is None:
            log(
                f"random {args.model_shape} checkpoint ({dtype}, {args.num_layers or 'all'} layers)"
            )
            model = str(shape_fixture(args.model_shape, dtype, root, args.num_layers))
        float_tps = None
        for quant in args.quantization.split(","):
            tag = dtype if quant == "none" else f"{dtype} {quant}"
            log(f"[{tag}] minisgl: {len(prompts)} requests x {args.output_len} tokens")
            ours, ours_single = run_minisgl(
                model,
                dtype,
                args.device,
                prompts,
                args.output_len,
                None if quant == "none" else quant,
            )
            log(f"[{tag}] minisgl: {ours:.1f} tok/s batch, {ours_single:.1f} tok/s single-stream")
            float_tps = ours if quant == "none" else float_tps
            quant_rows.append((tag, ours, ours_single, quant, float_tps))
            gc.collect()
        # transformers against the float model (or the only format run)
        ours, ours_single = next(
            (r[1], r[2]) for r in quant_rows if r[0] == dtype or r is quant_rows[-1]
        )
        if args.no_transformers:
            continue
        log(f"[{dtype}] transformers: same workload")
        sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
        hf_n = hf_limits.get(dtype, len(prompts))
        if hf_n < len(prompts):
            sizes = [b for b in sizes if b <= hf_n and hf_n % b == 0] or [hf_n]
            log(f"[{dtype}] transformers: first {hf_n} of {len(prompts)} requests only")
        hf, hf_single, bs = run_transformers(
            model, dtype, args.device, prompts[:hf_n], args.output_len, sizes
        )
        gc.collect()  # free one model before the next loads
        rows.append(
            (dtype, ours, hf, f"{bs}" if hf_n == len(prompts) else f"{bs}*", ours_single, hf_single)
        )

    log("")
    if rows:
        log(
            f"{'dtype':<9} {'minisgl tok/s':>14} {'transformers':>13} {'ratio':>6} | "
            f"{'1-stream minisgl':>16} {'transformers':>13} {'ratio':>6}"
        )
    for dtype, ours, hf, bs, s_ours, s_hf in rows:
        log(
            f"{dtype:<9} {ours:>14.1f} {hf:>10.1f}@{bs:<3} {ours / hf:>6.2f} | "
            f"{s_ours:>16.1f} {s_hf:>13.1f} {s_ours / s_hf:>6.2f}"
        )
    if any(str(r[3]).endswith("*") for r in rows):
        log("* transformers timed on the first --hf-requests requests only")
    if args.quantization != "none":
        log("")
        log(f"{'minisgl':<18} {'tok/s':>9} {'x float':>8} | {'1-stream':>9} {'x float':>8}")
        singles = {r[0].split()[0]: r[2] for r in quant_rows if r[3] == "none"}
        for tag, tps, single, _, base in quant_rows:
            base_single = singles.get(tag.split()[0])
            ratio = f"{tps / base:>8.2f}" if base else f"{'-':>8}"
            sratio = f"{single / base_single:>8.2f}" if base_single else f"{'-':>8}"
            log(f"{tag:<18} {tps:>9.1f} {ratio} | {single:>9.1f} {sratio}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
