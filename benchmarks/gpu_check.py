"""The GPU check: one command that says whether the CUDA path serves right, and how fast it decodes.

    python benchmarks/gpu_check.py            # on a GPU: all of it (minutes on one H200)
    python benchmarks/gpu_check.py --quick    # the CPU-safe parts at small sizes (seconds)
    scripts/gpu_check.sh                      # the same on a lent machine (wheels, paths, log)

Everything runs offline on random weights written here with the project's fixture writer
(Qwen3-0.6B and Qwen3-8B shapes on a GPU; the tiny test shape on the CPU), TP=1. Checks, each
printed PASS, FAIL or SKIP with its reason (the exit status is 1 if any failed):
  parity     greedy tokens equal transformers' on the same weights (bf16 on CUDA)
  backends   the flashinfer and torch attention backends agree
  graphs     decode replayed as CUDA graphs equals eager decode, and graphs did replay
  long       a 16k-token prompt (chunked prefill) on each backend agrees with transformers
  kv-fp8     --kv-cache-dtype fp8 on each backend agrees with transformers whose cache rounds
             keys and values to e4m3 the same way
  served     `python -m minisgl` on the device: ready, a chat completion, a streamed one, n=2
             with logprobs, /metrics, and a clean exit on SIGTERM
  quant      checkpoints in Qwen's published formats (FP8 blocks, AWQ, GPTQ 8-bit; a Qwen3-MoE
             in FP8 and GPTQ-Int4) against transformers on their dequantized twin, batched, in
             chunks and again from the prefix cache; on a GPU the load line must name the torch
             kernel each format takes (quant/cuda_matmul.py), on the CPU the C kernels run
"Equal" is token for token up to the first step where the two differ at a near-tie: a step
whose top-1/top-2 margin in the reference run is under --margin, in units of the standard
deviation of that step's logits (random weights' logits are flat: ~1 step in 3 is within 0.08 of
it; bf16 keeps ~3 digits, so two correct implementations may break such a tie differently,
after which their continuations differ); the tokens compared are printed.
Then figures:
  decode     step time at B=1/8/64 (context --context) for both shapes, graphs on and off,
             against the HBM roofline (read bandwidth measured in this run); the 0.6B shape
             also with --quantization int4 and fp8 (its own bytes' roofline)
  8 x 16     the seed's milestone workload: 8 concurrent requests of 16 output tokens (128
             prompt tokens), here through the offline engine (no HTTP)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minisgl import LLM, SamplingParams
from minisgl.testing.quant_writer import QuantFormat

PAGE = 16


@dataclass
class Report:
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (check, status, detail)
    start: float = field(default_factory=time.perf_counter)

    def add(self, check: str, status: str, detail: str) -> None:
        self.results.append((check, status, detail))
        print(
            f"[{time.perf_counter() - self.start:6.1f}s] {status:<4} {check}: {detail}", flush=True
        )

    def run(self, check: str, fn: Callable[[], str]) -> None:
        """PASS with fn's detail, FAIL with its AssertionError, or the exception that broke it."""
        try:
            self.add(check, "PASS", fn())
        except AssertionError as e:
            self.add(check, "FAIL", str(e))
        except Exception as e:  # noqa: BLE001 (a check that breaks is a failed check, say why)
            traceback.print_exc()
            self.add(check, "FAIL", f"{type(e).__name__}: {e}")

    def section(self, name: str, fn: Callable[[], None]) -> None:
        """Run a part; one that breaks is a failed check, and the parts after it still run."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.add(name, "FAIL", f"{type(e).__name__}: {e}")

    def summary(self) -> int:
        failed = [c for c, s, _ in self.results if s == "FAIL"]
        skipped = [c for c, s, _ in self.results if s == "SKIP"]
        print(
            f"\n{len(self.results)} checks: {len(failed)} failed {failed or ''}, "
            f"{len(skipped)} skipped {skipped or ''}"
        )
        return 1 if failed else 0


# -- comparing greedy runs --------------------------------------------------------------


@dataclass
class Run:
    tokens: list[list[int]]
    # per token: top-1 minus top-2, over the standard deviation of the reference's logits
    margins: list[list[float]]
    spread: float = 1.0  # that standard deviation, the mean over the steps (transformers' runs)


def compare(ref: Run, got: list[list[int]], margin: float, what: str) -> str:
    """Token for token up to the first step where they differ at a near-tie of the reference;
    AssertionError on a clear divergence."""
    compared = total = 0
    for i, (want, have) in enumerate(zip(ref.tokens, got, strict=True)):
        total += len(want)
        for j, w in enumerate(want):
            if j >= len(have) or have[j] != w:
                if ref.margins[i][j] < margin:
                    break  # a near-tie: either choice is right, the rest may differ
                raise AssertionError(
                    f"{what}: request {i} diverged at step {j} (reference margin "
                    f"{ref.margins[i][j]:.3f} >= {margin}): {have[: j + 1]} vs {want[: j + 1]}"
                )
            compared += 1
    # At least a quarter: random weights' logits are flat, and each kernel's own rounding (bf16
    # scales and zeros of the int4 matmul, fp8 activations) breaks some of their ties its way.
    assert compared and compared * 4 >= total, (
        f"{what}: only {compared}/{total} tokens clear of near-ties"
    )
    return f"{compared}/{total} tokens equal (the rest after a near-tie)"


def engine_run(llm: LLM, prompts: list[list[int]], max_tokens: int, spread: float = 1.0) -> Run:
    """Greedy tokens; their margins in units of `spread` (a reference's logits' deviation)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    margins = []
    for o in outs:
        assert o.logprobs is not None
        margins.append([(top[0] - top[1]) / spread for top in o.logprobs.top_logprobs])
    return Run([o.token_ids for o in outs], margins, spread)


def hf_runs(
    model_dir: Path,
    cases: list[tuple[list[list[int]], int]],
    dtype: torch.dtype,
    device: str,
    fp8_cache: bool = False,
) -> list[Run]:
    """transformers' greedy runs of each (prompts, max_tokens) case, the model loaded once;
    `fp8_cache`: its cache rounds keys and values to e4m3 as --kv-cache-dtype fp8 does."""
    from transformers import AutoModelForCausalLM

    from minisgl.testing.fp8_reference import rounding_cache

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    runs = []
    with torch.inference_mode():
        for ps, max_tokens in cases:
            tokens, margins, spreads = [], [], []
            for p in ps:
                out = model.generate(
                    torch.tensor([p], device=device),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                    max_new_tokens=max_tokens,  # it may stop at EOS: a shorter reference
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    cache=rounding_cache(model.config) if fp8_cache else None,
                )
                tokens.append(out.sequences[0, len(p) :].tolist())
                gaps = []
                for scores in out.scores:
                    logits = scores[0].float()
                    top, spread = logits.topk(2).values, float(logits.std())
                    gaps.append(float(top[0] - top[1]) / spread)
                    spreads.append(spread)
                margins.append(gaps)
            runs.append(Run(tokens, margins, statistics.fmean(spreads)))
    del model
    free_memory()
    return runs


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in lengths]


# -- the checks ---------------------------------------------------------------------------


@dataclass
class Setup:
    device: str
    dtype: str
    margin: float
    flashinfer: str | None  # why not, or None when it can run
    lengths: list[int]
    long_len: int
    max_tokens: int


def make_llm(
    model: Path, setup: Setup, pages: int, max_seq_len: int, prefill_chunk: int, **flags: Any
) -> LLM:
    """The offline engine on the setup's device and dtype, prompts over `prefill_chunk` tokens
    prefilled in chunks."""
    return LLM(
        str(model),
        dtype=setup.dtype,
        device=setup.device,
        num_pages=pages,
        page_size=PAGE,
        max_seq_len=max_seq_len,
        cpu_kernel_tuning="off",  # CPU runs here check tokens, not speed
        max_prefill_tokens=prefill_chunk,
        **flags,
    )


def backend_llm(model: Path, setup: Setup, backend: str, graphs: bool, pages: int) -> LLM:
    return make_llm(
        model, setup, pages, setup.long_len + 64, min(4096, setup.long_len // 4),
        attention_backend=backend, disable_cuda_graph=not graphs,
    )  # fmt: skip


def correctness(report: Report, model: Path, setup: Setup) -> None:
    ps = prompts(setup.lengths, seed=1)
    long = prompts([setup.long_len], seed=2)
    pages = (sum(setup.lengths) + setup.long_len) // PAGE + 64 * len(setup.lengths) + 64
    dt = getattr(torch, setup.dtype)
    t0 = time.perf_counter()
    hf, hf_long = hf_runs(model, [(ps, setup.max_tokens), (long, 8)], dt, setup.device)
    print(f"transformers reference runs: {time.perf_counter() - t0:.1f} s")

    backends = ["torch"] + ([] if setup.flashinfer else ["flashinfer"])
    runs: dict[str, Run] = {}
    long_runs: dict[str, Run] = {}

    def one_backend(backend: str) -> None:
        llm = backend_llm(model, setup, backend, graphs=backend == "flashinfer", pages=pages)
        try:
            if backend == "flashinfer":
                graphs = llm.engine.runner.decode_graphs
                assert graphs is not None, "decode graphs were not captured (see the log)"
            runs[backend] = engine_run(llm, ps, setup.max_tokens, hf.spread)
            t0 = time.perf_counter()
            long_runs[backend] = engine_run(llm, long, 8)
            long_s = time.perf_counter() - t0
            if backend == "flashinfer":
                replays = llm.engine.runner.decode_graphs.replays  # type: ignore[union-attr]
                assert replays > 0, "no decode step replayed a graph"
                eager = backend_llm(model, setup, backend, graphs=False, pages=pages)
                ref = engine_run(eager, ps, setup.max_tokens, hf.spread)
                eager.shutdown()
                report.run(
                    "graphs",
                    lambda ref=ref, n=replays: (
                        compare(ref, runs["flashinfer"].tokens, setup.margin, "graphs on/off")
                        + f"; {n} steps replayed"
                    ),
                )
        finally:
            llm.shutdown()
            del llm
            free_memory()
        report.run(
            f"parity[{backend}]",
            lambda b=backend: compare(hf, runs[b].tokens, setup.margin, f"{b} vs transformers"),
        )
        report.run(
            f"long[{backend}]",
            lambda b=backend, s=long_s: (
                compare(
                    hf_long, long_runs[b].tokens, setup.margin, f"{setup.long_len}-token prompt"
                )
                + f"; prompt + 8 tokens in {s:.2f} s"
            ),
        )

    for backend in backends:
        report.section(f"engine[{backend}]", lambda b=backend: one_backend(b))
    if setup.flashinfer:
        for check in ("backends", "graphs"):
            report.add(check, "SKIP", setup.flashinfer)
    else:
        report.run(
            "backends",
            lambda: compare(runs["torch"], runs["flashinfer"].tokens, setup.margin, "fi vs torch"),
        )


def fp8_cache(report: Report, model: Path, setup: Setup) -> None:
    """--kv-cache-dtype fp8 on each backend against transformers whose cache rounds its keys and
    values to e4m3 the same way."""
    ps = prompts(setup.lengths, seed=3)
    pages = sum(setup.lengths) // PAGE + 64 * len(setup.lengths) + 64
    (hf,) = hf_runs(
        model, [(ps, setup.max_tokens)], getattr(torch, setup.dtype), setup.device, True
    )
    for backend in ["torch"] + ([] if setup.flashinfer else ["flashinfer"]):
        llm = make_llm(
            model, setup, pages, max(setup.lengths) + setup.max_tokens + 16, 4096,
            attention_backend=backend, kv_cache_dtype="fp8",
        )  # fmt: skip
        try:
            run = engine_run(llm, ps, setup.max_tokens, hf.spread)
        finally:
            llm.shutdown()
            del llm
            free_memory()
        report.run(
            f"kv-fp8[{backend}]",
            lambda r=run, b=backend: compare(hf, r.tokens, setup.margin, f"{b}, fp8 KV cache"),
        )


# -- the server -----------------------------------------------------------------------------


def served(model: Path, setup: Setup) -> str:
    """The server as users start it, on this device: each request answered, then a clean exit."""
    import subprocess

    import httpx

    from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="gpu-check-server-")) / "server.log"
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model), "--port", str(port)]
    cmd += ["--device", setup.device, "--dtype", setup.dtype, "--num-pages", "2048"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.perf_counter()
        ready = wait_http_ok(proc, base + "/health", 600)
        assert ready, f"not ready (exit {proc.poll()}); its log: {log}"
        start_s = time.perf_counter() - t0
        chat = {"model": str(model), "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(base + "/v1/chat/completions", json=chat | {"max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length", r.text
        with httpx.stream(
            "POST", base + "/v1/chat/completions", timeout=60,
            json=chat | {"max_tokens": 8, "stream": True},
        ) as r:  # fmt: skip
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]", events[-3:]
        body = {"model": str(model), "prompt": "1 2 3", "max_tokens": 8, "n": 2, "logprobs": 2}
        r = httpx.post(base + "/v1/completions", json=body | {"temperature": 0.8}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert "minisgl_model_info{" in metrics, metrics[:500]
    finally:
        code = stop_process(proc)  # SIGTERM to the server alone, as Kubernetes sends it
    assert code == 0, f"exit code {code} after SIGTERM; its log: {log}"
    shutil.rmtree(log.parent)  # kept only where a check failed, to be read
    return f"ready in {start_s:.1f} s; chat, a stream of {len(events)} events, n=2 with logprobs"


# -- quantized checkpoints ----------------------------------------------------------------

# name: (MoE?, format, the GPU kernel its load line must name; None: dequantized at load)
QUANT_CASES: dict[str, tuple[bool, QuantFormat, str | None]] = {
    "fp8 block": (False, QuantFormat("fp8"), "fp8 scaled_mm"),
    "awq": (False, QuantFormat("awq"), "int4 weight-only matmul"),
    "gptq 8-bit": (False, QuantFormat("gptq", bits=8), None),
    "moe fp8 block": (True, QuantFormat("fp8"), "fp8 scaled_mm"),
    "moe gptq int4": (True, QuantFormat("gptq"), "int4 weight-only matmul"),
}
QUICK_QUANT_CASES = ("fp8 block", "moe gptq int4")
GPU_LOAD_LINE = "quantized weights on the GPU: "


def fp8_reference_kernel(block: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """What cuda_matmul.fp8_kernel asks of scaled_mm, in plain float32 torch: the activations
    quantized to fp8 the same way, times the fp8 weight and its (padded block or row) scales."""
    from minisgl.quant import cuda_matmul

    def run(x: torch.Tensor, w: Any) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        group = block or k
        codes, a_scale = cuda_matmul.quantize_activations(x2, group)
        xq = (codes.float().view(codes.shape[0], -1, group) * a_scale.unsqueeze(-1)).view(-1, k)
        n = w.codes.shape[0]
        if block:
            s = w.scales[:, : k // block]  # [N/b, K/b padded] -> [N/b, K/b]
            scales = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)
        else:
            scales = w.scales.reshape(n, 1)
        y = xq @ (w.codes.float() * scales).t()
        return y[: x2.shape[0]].to(x.dtype).reshape(*lead, n)

    return run


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load_line(llm_factory: Callable[[], LLM]) -> tuple[LLM, str | None]:
    """The LLM `llm_factory` makes, and the GPU conversion's log line at its load (or None)."""
    log = logging.getLogger("minisgl.quant.loading")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        llm = llm_factory()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return llm, next((x for x in handler.lines if x.startswith(GPU_LOAD_LINE)), None)


def quantized(report: Report, root: Path, setup: Setup, quick: bool) -> None:
    from minisgl.testing.fixture import write_fixture_model
    from minisgl.testing.quant_writer import write_quantized_pair

    # Matmul dims multiples of 128: the 0.6B shape cut to 4 layers on a GPU (the tiny "quant"
    # preset on the CPU), and the small Qwen3-MoE preset made for these formats.
    dense = ("0.6b", 4) if setup.device == "cuda" else ("quant", None)
    sources = {
        False: write_fixture_model(root / "quant-dense", dense[0], num_hidden_layers=dense[1]),
        True: write_fixture_model(root / "quant-moe", "quant-moe"),
    }
    ps = prompts([1, 7, 33, 100, 300], seed=5)
    pages = sum(len(p) for p in ps) // PAGE + 16 * len(ps) + 16
    for name in QUICK_QUANT_CASES if quick else QUANT_CASES:
        moe, fmt, kernel = QUANT_CASES[name]
        slug = name.replace(" ", "-")
        quant, twin = root / f"q-{slug}", root / f"t-{slug}"
        write_quantized_pair(sources[moe], quant, twin, fmt)
        (hf,) = hf_runs(twin, [(ps, setup.max_tokens)], getattr(torch, setup.dtype), setup.device)
        # fp8 weights meet fp8-quantized x on a GPU (scaled_mm); the CPU kernels keep x as it is
        fp8_x = fmt.method == "fp8" and setup.device == "cuda"
        report.run(
            f"quant[{name}]",
            lambda n=name, q=quant, k=kernel, h=hf, f=fp8_x: quant_check(
                n, q, k, h, f, ps, setup, pages
            ),
        )


def quant_check(
    name: str,
    quant: Path,
    kernel: str | None,
    hf: Run,
    fp8_x: bool,
    ps: list[list[int]],
    setup: Setup,
    pages: int,
) -> str:
    """The quantized checkpoint's greedy tokens, batched, in chunks and again from the prefix
    cache, against transformers on its dequantized twin; where the activations are quantized
    too (`fp8_x`) against the same arithmetic in plain torch instead (fp8 activations move a
    random model's flat logits past many of the twin's ties: the twin's agreement is printed)."""
    from unittest import mock

    from minisgl.quant import cuda_matmul

    def load() -> LLM:
        return make_llm(quant, setup, pages, max_seq_len=512, prefill_chunk=64)

    llm, line = load_line(load)
    print(f"{name}: {line or 'no quantized-weights line at load'}", flush=True)
    try:
        first = engine_run(llm, ps, setup.max_tokens)
        again = engine_run(llm, ps, setup.max_tokens)  # every prompt a prefix-cache hit
    finally:
        llm.shutdown()
        free_memory()
    said = ""
    if setup.device == "cuda":
        assert line is not None, "no quantized-weights line at load"
        if kernel is None:
            assert "dequantized to" in line, line
        else:
            assert kernel in line and "dequantized" not in line, line
        said = f" ({line.removeprefix(GPU_LOAD_LINE)})"
    ref, what = hf, "transformers"
    if fp8_x:
        with mock.patch.object(cuda_matmul, "fp8_kernel", fp8_reference_kernel):
            plain = load()
        try:
            ref, what = engine_run(plain, ps, setup.max_tokens, hf.spread), "plain torch"
        finally:
            plain.shutdown()
            free_memory()
        try:
            said += "; against transformers on the twin: " + compare(
                hf, first.tokens, setup.margin, "twin"
            )
        except AssertionError as e:
            said += f"; against transformers on the twin (bf16 activations): {e}"
    return (
        compare(ref, first.tokens, setup.margin, f"{name} vs {what}")
        + "; from the prefix cache: "
        + compare(ref, again.tokens, setup.margin, f"{name} rerun vs {what}")
        + said
    )


# -- figures --------------------------------------------------------------------------


def hbm_read_bandwidth() -> float:
    """Bytes/s a reduction over 4 GiB streams (best of 10): what a decode step can read."""
    x = torch.ones(2**31, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del x
    free_memory()
    return 2**32 / best


def decode_figures(
    report: Report,
    shape: str,
    layers: int | None,
    root: Path,
    args: Any,
    bandwidth: float,
    quantization: str | None = None,
) -> None:
    from bench_models import decode_bytes_per_token
    from bench_models import fixture as shape_fixture
    from decode_step import decode_input
    from roofline import linear_weights

    from minisgl.config import EngineArgs
    from minisgl.engine.model_runner import ModelRunner
    from minisgl.models.config import ModelConfig

    t0 = time.perf_counter()
    model = shape_fixture(shape, "bfloat16", root, layers)
    print(f"{shape} fixture ready in {time.perf_counter() - t0:.1f} s")
    config = ModelConfig.from_dir(model)
    label = f"{shape} {quantization}" if quantization else shape
    batches = [1, 8, 64]
    pages = max(batches) * -(-(args.context + 1) // PAGE) + 8
    rows = []
    for graphs in (True, False):
        eargs = EngineArgs(
            model=str(model),
            dtype="bfloat16",
            device="cuda",
            num_pages=pages,
            page_size=PAGE,
            attention_backend=args.figures_backend,
            disable_cuda_graph=not graphs,
            quantization=quantization,
        )
        runner = ModelRunner(eargs, model, config, max_seq_len=args.context + 64)
        if graphs and runner.decode_graphs is None:
            report.add(
                f"decode[{label}]",
                "SKIP",
                "no decode graphs (torch backend, or the "
                "capture failed: see the log); eager figures follow",
            )
            del runner
            free_memory()
            continue
        _, weight_bytes = linear_weights(runner.model)
        kv_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
        for b in batches:
            inp = decode_input(b, args.context)
            for _ in range(3):
                runner.forward(inp)
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.forward(inp)  # ends in the sampled tokens' copy to the host
                times.append(time.perf_counter() - t)
            nbytes = (
                decode_bytes_per_token(runner.model, args.context, runner.dtype)
                if b == 1
                else weight_bytes + b * args.context * kv_token
            )
            floor = nbytes / bandwidth
            med = statistics.median(times)
            rows.append(
                f"{label:<15} B={b:<3} graphs {'on ' if graphs else 'off'} median "
                f"{med * 1e3:7.3f} ms best {min(times) * 1e3:7.3f} ms  {b / med:8.0f} tok/s  "
                f"roofline {floor * 1e3:6.3f} ms ({nbytes / 1e9:.2f} GB): {floor / med:4.0%}"
            )
            print(rows[-1], flush=True)
        del runner
        free_memory()
    report.add(f"decode[{label}]", "PASS", f"{len(rows)} figures (above)")


def milestone(report: Report, model: Path, args: Any) -> None:
    llm = LLM(
        str(model),
        dtype="bfloat16",
        device="cuda",
        num_pages=1024,
        page_size=PAGE,
        max_seq_len=1024,
        attention_backend=args.figures_backend,
    )
    ps = prompts([128] * 8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(ps, params)  # warm-up
    ps = prompts([128] * 8, seed=4)  # new prompts: the prefix cache would serve the old ones
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(ps, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    llm.shutdown()
    del llm
    free_memory()
    report.add(
        "8 x 16", "PASS", f"{n} tokens in {dt * 1e3:.0f} ms: {n / dt:.0f} tok/s (0.6B shape)"
    )


def flashinfer_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="CPU-safe parts at small sizes only")
    ap.add_argument(
        "--model",
        default=None,
        help="CPU parts: a float32 checkpoint to use instead of writing the tiny fixture",
    )
    ap.add_argument("--root", default=None, help="where fixtures are written (default: a temp dir)")
    ap.add_argument(
        "--margin",
        type=float,
        default=None,
        help="near-tie margin in standard deviations of the logits (default: 0.08 in bf16 on "
        "CUDA, 1e-3 in float32 on the CPU)",
    )
    ap.add_argument("--context", type=int, default=1024, help="decode figures' context")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers-8b", type=int, default=None, help="cut the 8B shape's depth")
    ap.add_argument("--no-8b", action="store_true", help="no 8B-shaped figures")
    ap.add_argument("--figures-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    args = ap.parse_args(argv)
    report = Report()
    cuda = torch.cuda.is_available() and not args.quick
    print(
        f"torch {torch.__version__}, "
        + (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if cuda else "CPU")
        + (
            f", flashinfer {_version('flashinfer')}"
            if importlib.util.find_spec("flashinfer")
            else ", no flashinfer"
        )
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(args.root or tmp)
        if cuda:
            from bench_models import fixture as shape_fixture

            model = shape_fixture("qwen3-0.6b", "bfloat16", root)
            setup = Setup(
                "cuda",
                "bfloat16",
                args.margin or 0.08,
                flashinfer_missing(),
                [1, 7, 33, 100, 300, 1000],
                16384,
                24,
            )
        else:
            from minisgl.testing.fixture import write_fixture_model

            if not args.quick:
                print("no CUDA: the CPU-safe parts at small sizes (as --quick)")
            model = Path(args.model) if args.model else write_fixture_model(root / "tiny", "tiny")
            setup = Setup("cpu", "float32", args.margin or 1e-3, "needs CUDA", [1, 7, 33], 1024, 8)
        print(f"TP=1; greedy; near-tie margin {setup.margin}")
        if not setup.flashinfer:
            print("flashinfer compiles its kernels on first use unless its JIT cache is installed")
        report.section("correctness", lambda: correctness(report, model, setup))
        report.section("kv-fp8", lambda: fp8_cache(report, model, setup))
        report.run("served", lambda: served(model, setup))
        report.section("quant", lambda: quantized(report, root, setup, quick=not cuda))
        if not cuda:
            for check in ("decode", "8 x 16"):
                report.add(check, "SKIP", "figures of a GPU (CPU decode: decode_step.py)")
            return report.summary()
        bandwidth = hbm_read_bandwidth()
        print(f"HBM read bandwidth (bf16 sum over 4 GiB, best of 12): {bandwidth / 1e12:.2f} TB/s")
        report.section(
            "decode[qwen3-0.6b]",
            lambda: decode_figures(report, "qwen3-0.6b", None, root, args, bandwidth),
        )
        for q in ("int4", "fp8"):
            report.section(
                f"decode[qwen3-0.6b {q}]",
                lambda q=q: decode_figures(report, "qwen3-0.6b", None, root, args, bandwidth, q),
            )
        report.section("8 x 16", lambda: milestone(report, model, args))
        # Last: writing 16 GB of random weights is the slowest part.
        if args.no_8b:
            report.add("decode[qwen3-8b]", "SKIP", "--no-8b")
        else:
            report.section(
                "decode[qwen3-8b]",
                lambda: decode_figures(report, "qwen3-8b", args.layers_8b, root, args, bandwidth),
            )
    return report.summary()


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name + "-python") if name == "flashinfer" else version(name)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
