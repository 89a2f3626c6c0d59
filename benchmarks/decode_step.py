"""One engine step at a time, without the scheduler: where a forward pass spends its time.

Times ModelRunner.forward on a random fixture (Qwen3-0.6B shape by default) for decode batches
(B requests, one new token each, at a given context) and for a prefill chunk (requests of
--prefill-len new tokens up to --prefill-tokens in one step). Repeats interleave the cases, so
noise from other work on the machine spreads over all of them; the best and median of the
repeats are printed, with the machine's measured roofline (read bandwidth, matmul peak:
roofline.py) and each case's best as a fraction of it (the bytes a decode step must read: for a
mixture of experts only the k routed experts per layer at B=1).

    python benchmarks/decode_step.py --dtype bfloat16 --batches 1,8,32 --context 320
    python benchmarks/decode_step.py --model-shape qwen3-30b-a3b --num-layers 4 --batches 1
    python benchmarks/decode_step.py --profile 1     # torch profiler table for B=1 decode
    python benchmarks/decode_step.py --quantization int4 --breakdown 1
                                                     # B=1 step: ms per part (matmuls by shape,
                                                     # attention, norms, sampling, the rest)
    python benchmarks/decode_step.py --timings       # each case's spread of step times, and
                                                     # what happened during its steps, next to
                                                     # the pure read loop's (same bytes)
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_models import MODEL_SHAPES, decode_bytes_per_token
from bench_models import fixture as shape_fixture
from roofline import Machine, linear_weights
from roofline import measure as measure_machine

from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput, ModelRunner
from minisgl.layers import cpu_kernels
from minisgl.models.config import ModelConfig
from minisgl.process import freeze_startup_objects
from minisgl.sampling_params import SamplingParams

PAGE = 16


def decode_input(batch: int, context: int) -> ForwardInput:
    """`batch` requests that each have `context` tokens cached and decode one more."""
    pages_per = -(-(context + 1) // PAGE)
    tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(batch)]
    return ForwardInput(
        token_ids=[(17 * i + 5) % 150000 for i in range(batch)],
        prefix_lens=[context] * batch,
        extend_lens=[1] * batch,
        page_tables=tables,
        sample_rows=list(range(batch)),
        sample_params=[SamplingParams(temperature=0)] * batch,
        sample_steps=[0] * batch,
        sample_seeds=[0] * batch,
    )


def prefill_input(total: int, length: int) -> ForwardInput:
    """Prompts of `length` tokens (no cached prefix) filling a `total`-token chunk."""
    n = max(1, total // length)
    pages_per = -(-length // PAGE)
    tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(n)]
    return ForwardInput(
        token_ids=[(31 * i + 7) % 150000 for i in range(n * length)],
        prefix_lens=[0] * n,
        extend_lens=[length] * n,
        page_tables=tables,
        sample_rows=list(range(n)),
        sample_params=[SamplingParams(temperature=0)] * n,
        sample_steps=[0] * n,
        sample_seeds=[0] * n,
    )


_MATMULS = ("gemv", "gemv512", "gemm", "panel")


def _label_kernels() -> None:
    """Make the C kernels (called through ctypes, invisible to the profiler) show up by name."""
    from torch.profiler import record_function

    def labelled(name: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            n = getattr(a[1], "n", None) or a[1].shape[0] if name in _MATMULS else 0
            with record_function(f"minisgl::{name}" + (f"[N={n}]" if n else "")):
                return fn(*a, **kw)

        return run

    for name in (*_MATMULS, "decode_attention", "rms_norm", "silu_mul"):
        setattr(cpu_kernels, name, labelled(name, getattr(cpu_kernels, name)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model dir (default: the random 0.6B fixture)")
    ap.add_argument("--fixture-dir", default="/tmp/minisgl-bench-models")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers (shape's default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--quantization",
        default="",
        help="int8|int4|fp8, or several comma-separated ('none' for the float model): each "
        "measured on the same fixture in one run, side by side; FORMAT:HEAD gives that one "
        "its own LM head format (e.g. int4:int4 beside int4, whose head is int8), and a /x8 "
        "suffix runs it with --cpu-quantized-activations int8 (e.g. int8,int8/x8,int4,int4/x8), "
        "and an @KV suffix with --kv-cache-dtype KV (e.g. none,none@fp8,int4@fp8)",
    )
    ap.add_argument(
        "--lm-head-quantization",
        default="auto",
        choices=("auto", "none", "int8", "int4", "fp8"),
        help="the LM head's format (auto: int8 per channel under --quantization, float for "
        "the float model); a 151936-row head is a large share of a 4-bit step's bytes",
    )
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="0: skip prefill")
    ap.add_argument("--prefill-len", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--profile", type=int, default=0, help="profile decode at this batch size")
    ap.add_argument(
        "--breakdown",
        type=int,
        default=0,
        help="decode at this batch size: ms per step in each part (timers around the calls, "
        "no profiler: its per-op cost would swamp a 1-row step's small ops), per format",
    )
    ap.add_argument(
        "--timings",
        action="store_true",
        help="per case: step-time percentiles, and per step the page faults, context switches "
        "(involuntary: another task took a core) and garbage collections, with the median of "
        "the steps that no other task interrupted; and the same for the pure read loop over "
        "the weights' bytes, run between the steps (the spread the memory alone shows)",
    )
    ap.add_argument("--cpu-kernel-tuning", default="cached", choices=("cached", "full", "off"))
    ap.add_argument(
        "--cpu-weight-copies-max-gb",
        type=float,
        default=0.0,
        help="memory for second weight layouts (default 0: each weight once, as the server)",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: the process's CPU time; with --threads 1 it leaves out the time other work "
        "held the core (ratios on a busy shared machine; not comparable to wall-clock figures)",
    )
    args = ap.parse_args(argv)
    # The kernel chooser's one line (what runs for which shape and row count) is worth seeing.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    # Before the model loads: nothing of ours (huge-page compaction included) is running yet.
    machine = measure_machine((args.dtype,), clock)

    model = (
        Path(args.model)
        if args.model
        else shape_fixture(args.model_shape, args.dtype, Path(args.fixture_dir), args.num_layers)
    )
    config = ModelConfig.from_dir(model)
    batches = [int(b) for b in args.batches.split(",") if b]
    # --breakdown / --profile's batch too: their page tables index the same pool (a larger
    # batch than the pool holds read and wrote past it).
    rows = batches + [args.breakdown, args.profile]
    pages_needed = max(
        [b * -(-(args.context + 1) // PAGE) for b in rows] + [args.prefill_tokens // PAGE + 64, 64]
    )
    # One runner per weight format ("none": the float model), all resident, so the repeats
    # interleave every format and case: the formats are compared under the same noise.
    formats = [q.strip() for q in args.quantization.split(",")] if args.quantization else [""]
    builds = {q or "none": _build(args, model, config, batches, pages_needed, q) for q in formats}

    if args.profile:
        runner = next(iter(builds.values()))[0]
        _label_kernels()
        inp = decode_input(args.profile, args.context)
        for _ in range(3):
            runner.forward(inp)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner.forward(inp)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return 0

    if args.breakdown:
        runners = {q: b[0] for q, b in builds.items()}
        print(breakdown(runners, decode_input(args.breakdown, args.context), args.repeats, clock))
        return 0

    times = {(q, k): [] for q, (_, cases, *_) in builds.items() for k in cases}
    events: dict[tuple[str, str], list[StepEvents]] = {key: [] for key in times}

    def activations(q: str) -> None:  # a process-wide switch: set before each format's steps
        cpu_kernels.set_quantized_activations("int8" if q.endswith("/x8") else "int16")

    for q, (runner, cases, *_) in builds.items():
        activations(q)
        for inp, *_ in cases.values():
            runner.forward(inp)  # warm-up: kernels built, tables cached
    # As the server's scheduler does once its engine is built: the models' objects live until
    # the end, so no full collection walks them during a step (one over a 0.6B runner's ~250k
    # objects took ~200 ms on the Zen 4 of docs/performance.md: a step's time 7x over).
    freeze_startup_objects()
    # The pure read loop over as many bytes as the first format's weights, one pass between
    # the repeats: a VM's memory rate moves by tens of percent within minutes (docs/
    # performance.md), so the roofline is the best read of the whole run, as the steps' best
    # is, not only the one taken before the steps; --timings also prints its spread.
    reader = ReadLoop(next(iter(builds.values()))[3], machine)
    for _ in range(args.repeats):
        for name in next(iter(builds.values()))[1]:
            for q, (runner, cases, *_) in builds.items():
                activations(q)
                before = StepEvents.now()
                t0 = clock()
                runner.forward(cases[name][0])
                times[(q, name)].append(clock() - t0)
                events[(q, name)].append(StepEvents.now() - before)
        reader.run(clock)
    machine.read_bytes_per_s = max(machine.read_bytes_per_s, reader.best_rate())
    print(machine.describe())
    print(reader.report() if args.timings else reader.summary())
    first = next(iter(builds))
    for q, (_, cases, params, weight_bytes) in builds.items():
        print(
            f"{args.dtype}, weights {q}: {params / 1e6:.0f} M matmul parameters "
            f"({weight_bytes / 1e9:.2f} GB), {args.clock} clock"
        )
        mine = {name: times[(q, name)] for name in cases}
        for name, (_, tokens, nbytes, flops) in cases.items():
            best, med = min(mine[name]), statistics.median(mine[name])
            floor, bound = machine.floor_s(nbytes, flops, args.dtype)
            vs = min(times[(first, name)]) / best
            print(
                f"{name:<34} best {best * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  "
                f"{tokens / best:8.1f} tok/s (best)  roofline {floor * 1e3:7.1f} ms ({bound}): "
                f"{floor / best:4.0%}" + (f"  {vs:.2f}x {first}'s speed" if q != first else "")
            )
            if args.timings:
                print(spread(mine[name], events[(q, name)]))
            if args.timings:
                print(reader.against(mine[name]))
        print(batch_ratios(cases, mine, machine, args.dtype))
    return 0


def _build(
    args: argparse.Namespace,
    model: Path,
    config: ModelConfig,
    batches: list[int],
    pages_needed: int,
    fmt: str,
) -> tuple[ModelRunner, dict[str, tuple[ForwardInput, int, float, float]], int, int]:
    """The runner for one weight format, its cases (name -> input, tokens, bytes a step must
    read, FLOPs), its matmul parameters and their bytes. `fmt`: --quantization's entry,
    FORMAT[:HEAD][/x8][@KV]."""
    fmt, _, kv_cache = fmt.partition("@")
    x8 = fmt.endswith("/x8")
    quantization, _, head = fmt.removesuffix("/x8").partition(":")
    eargs = EngineArgs(
        model=str(model),
        dtype=args.dtype,
        device="cpu",
        num_pages=pages_needed,
        page_size=PAGE,
        cpu_kernel_tuning=args.cpu_kernel_tuning,
        cpu_weight_copies_max_gb=args.cpu_weight_copies_max_gb,
        quantization=quantization if quantization not in ("", "none") else None,
        lm_head_quantization=head or args.lm_head_quantization,
        cpu_quantized_activations="int8" if x8 else "int16",
        kv_cache_dtype=kv_cache or "auto",
    )
    runner = ModelRunner(eargs, model, config, max_seq_len=4096)
    params, weight_bytes = linear_weights(runner.model)
    kv_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
    kv_token *= runner.kv_pool.k_buffers[0].element_size()
    one = decode_bytes_per_token(runner.model, args.context, runner.kv_pool.cache_dtype)
    # B=1 reads only what one token touches (a mixture of experts: its k routed experts), more
    # rows are counted as all the weights.
    cases: dict[str, tuple[ForwardInput, int, float, float]] = {}
    size = runner.dtype.itemsize  # a float weight's bytes (the LM head may be quantized)
    for b in batches:
        nbytes = one if b == 1 else weight_bytes + b * args.context * kv_token
        active = params if eargs.quantization else min(params, nbytes / size)
        cases[f"decode B={b} ctx={args.context}"] = (
            decode_input(b, args.context),
            b,
            nbytes,
            2.0 * active * b,
        )
    if args.prefill_tokens:
        inp = prefill_input(args.prefill_tokens, args.prefill_len)
        n = len(inp.token_ids)
        # Logits only for each request's last token.
        head = math.prod(runner.model.lm_head.weight.shape)
        flops = 2.0 * ((params - head) * n + head * len(inp.sample_rows))
        cases[f"prefill {n} tok ({args.prefill_len}/req)"] = (inp, n, weight_bytes, flops)
    return runner, cases, params, weight_bytes


class PartTimer:
    """Seconds per named part of a step, by wrappers around the callables that do each part.
    A part's time is its own: what wrapped calls inside it took is theirs (a matmul's Python
    and the C kernel it calls are two parts); what no wrapper covers (the model's Python
    between the calls, torch's small ops) is the step's rest."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open call: its wrapped callees' time so far

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            self._inner.append(0.0)
            t0 = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                took = self.clock() - t0
                inner = self._inner.pop()
                if self._inner:
                    self._inner[-1] += took
                key = name(*a) if callable(name) else name
                self.seconds[key] = self.seconds.get(key, 0.0) + took - inner

        return timed


def _shape_name(m: Any, x: torch.Tensor) -> str:
    if m.weight is None:  # held in parts: the parts' own calls are timed as theirs
        return "matmul parts (Python)"
    n, k = m.weight.shape[-2:]
    return f"matmul {n}x{k} (Python)"


@contextmanager
def _timed_parts(timer: PartTimer) -> Iterator[None]:
    """Wrap the step's parts (class methods, module functions, the C entry points) while
    inside."""
    from minisgl.layers.attention.torch_backend import TorchAttentionBackend
    from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from minisgl.layers.linear import LinearBase
    from minisgl.layers.norm import RMSNorm

    lib = cpu_kernels.load()
    patches: list[tuple[Any, str, str | Callable[..., str]]] = [
        (LinearBase, "matmul", _shape_name),
        (ParallelLMHead, "forward", "LM head (Python)"),
        (VocabParallelEmbedding, "forward", "embedding"),
        (RMSNorm, "add_forward", "norms (Python)"),
        (RMSNorm, "forward", "norms (Python)"),
        (cpu_kernels, "rms_norm", "norm kernels' Python"),
        (TorchAttentionBackend, "forward", "attention (Python)"),
        (TorchAttentionBackend, "prepare", "attention metadata"),
        (cpu_kernels, "silu_mul", "SiLU x up (Python)"),
        (ModelRunner, "_sample", "sampling"),
    ]
    tables: list[tuple[dict[str, Any], str, str]] = []
    if lib is not None:
        patches += [
            (lib, "attn_bf16", "C attention"),
            (lib, "attn_f32", "C attention"),
            (lib, "norm_bf16", "C norms"),
            (lib, "norm_f32", "C norms"),
            (lib, "silu_mul_bf16", "C SiLU x up"),
            (lib, "silu_mul_f32", "C SiLU x up"),
            (lib, "bf16", "C float matmuls"),
            (lib, "gemv512_bf16", "C float matmuls"),
            (lib, "amx", "C float matmuls"),
            (lib, "panel", "C float matmuls"),
            # The decode chain (layers/cpu_chain.py) runs every layer's kernels in one call:
            # MINISGL_CPU_DECODE_CHAIN=0 splits them into the parts above.
            (lib, "decode_chain", "C decode chain (all layers)"),
            (lib, "decode_chain_timed", "C decode chain (all layers)"),
        ]
        for table in ("qgemv", "qamxi", "qamx", "qpanel", "qpanel16"):
            tables += [(getattr(lib, table), kind, f"C {table}") for kind in getattr(lib, table)]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    kept = [(t, kind, t[kind]) for t, kind, _ in tables]
    try:
        for obj, attr, name in patches:
            if getattr(obj, attr) is not None:
                setattr(obj, attr, timer.wrap(name, getattr(obj, attr)))
        for t, kind, name in tables:
            t[kind] = timer.wrap(name, t[kind])
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
        for t, kind, fn in kept:
            t[kind] = fn


def breakdown(
    runners: dict[str, ModelRunner], inp: ForwardInput, repeats: int, clock: Callable[[], float]
) -> str:
    """Per format, ms per step in each part (the median over `repeats` interleaved steps per
    part), the step itself, and the rest no part covers."""
    from minisgl.layers import cpu_chain

    parts: dict[str, dict[str, list[float]]] = {q: {} for q in runners}
    for runner in runners.values():
        runner.forward(inp)
    for _ in range(max(3, repeats)):
        for q, runner in runners.items():
            timer = PartTimer(clock)
            # The decode chain's ops, each timed by the C loop (one clock read per op).
            cpu_chain.timing, cpu_chain.timing_cpu_clock = {}, clock is time.process_time
            try:
                with _timed_parts(timer):
                    t0 = clock()
                    runner.forward(inp)
                    total = clock() - t0
                ops = cpu_chain.timing
            finally:
                cpu_chain.timing = None
            if ops:  # the chain call's own part is what its ops leave
                chain = "C decode chain (all layers)"
                timer.seconds[chain] = timer.seconds.get(chain, 0.0) - sum(ops.values())
                for k, v in ops.items():
                    timer.seconds[k] = timer.seconds.get(k, 0.0) + v
            timer.seconds["rest (model's Python, torch ops)"] = total - sum(timer.seconds.values())
            timer.seconds["step"] = total
            for k, v in timer.seconds.items():
                parts[q].setdefault(k, []).append(v)
    names = list(dict.fromkeys(k for p in parts.values() for k in p))
    names.sort(key=lambda k: (k == "step", k.startswith("rest"), not k.startswith("C "), k))
    rows = [f"{'ms per step (median)':<36}" + "".join(f"{q:>10}" for q in runners)]
    for k in names:
        cells = [statistics.median(parts[q][k]) * 1e3 if k in parts[q] else 0.0 for q in runners]
        rows.append(f"{k:<36}" + "".join(f"{c:10.2f}" for c in cells))
    return "\n".join(rows)


@dataclass(frozen=True)
class StepEvents:
    """What the process went through during a step: page faults, context switches (voluntary:
    a thread waited; involuntary: another task took its core) and garbage collections."""

    faults: int
    waits: int
    preempted: int
    collections: int

    @staticmethod
    def now() -> StepEvents:
        use = resource.getrusage(resource.RUSAGE_SELF)
        runs = sum(g["collections"] for g in gc.get_stats())
        faults = use.ru_minflt + use.ru_majflt
        return StepEvents(faults, use.ru_nvcsw, use.ru_nivcsw, runs)

    def __sub__(self, other: StepEvents) -> StepEvents:
        return StepEvents(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def spread(times: list[float], events: list[StepEvents]) -> str:
    """A case's step times as percentiles, what its steps went through on average, and the
    median of the steps no other task interrupted next to that of those it did."""
    ms = sorted(t * 1e3 for t in times)
    n = len(events)
    quiet = [t * 1e3 for t, e in zip(times, events) if e.preempted == 0]
    hit = [t * 1e3 for t, e in zip(times, events) if e.preempted > 0]

    def pct(p: float) -> float:
        return ms[min(n - 1, int(p * n))]

    def med(v: list[float]) -> str:
        return f"{statistics.median(v):.1f} ms ({len(v)} steps)" if v else "none"

    def mean(field: str) -> float:
        return sum(getattr(e, field) for e in events) / n

    return (
        f"    steps: p10 {pct(0.1):.1f}  p50 {statistics.median(ms):.1f}  p90 {pct(0.9):.1f}  "
        f"max {ms[-1]:.1f} ms, median/best {statistics.median(ms) / ms[0]:.2f}; per step "
        f"{mean('faults'):.1f} page faults, {mean('waits'):.1f} waits, "
        f"{mean('preempted'):.1f} preemptions, {mean('collections'):.2f} gc runs\n"
        f"    median of the steps not preempted: {med(quiet)}; preempted: {med(hit)}"
    )


class ReadLoop:
    """roofline's best read loop over the weights' `nbytes` (at most READ_MAX of them: an 8B
    model's 16 GB are not allocated twice) on huge pages, as the weights lie, one pass per
    repeat, with what the process went through during it (StepEvents)."""

    READ_MAX = 1 << 30

    def __init__(self, nbytes: int, machine: Machine) -> None:
        from roofline import READ_LOOPS, _stream_lib

        from minisgl import hugepages

        self.raw = _stream_lib()
        self.loop = machine.read.loop if machine.read and self.raw is not None else "plain"
        self.ahead, self.l2, self.narrow = READ_LOOPS[self.loop]
        numel = max(64, min(nbytes, self.READ_MAX) // 4)
        self.buf = hugepages.empty(numel, dtype=torch.float32).fill_(1.0)
        self.scale = max(nbytes, 1) / (numel * 4)  # the weights' bytes over the pass's
        self.times: list[float] = []
        self.events: list[StepEvents] = []

    def run(self, clock: Callable[[], float]) -> None:
        before = StepEvents.now()
        t0 = clock()
        if self.raw is not None:
            self.raw.stream_read_ahead(
                self.buf.data_ptr(), self.buf.numel(), self.ahead, self.l2, self.narrow
            )
        else:
            self.buf.sum()
        self.times.append(clock() - t0)
        self.events.append(StepEvents.now() - before)

    def against(self, steps: list[float]) -> str:
        """Each step over the read pass of its repeat (as if the pass read the weights' bytes):
        where the memory's rate moves, step and pass move together and this ratio spreads less
        than either."""
        ratios = sorted(t / (r * self.scale) for t, r in zip(steps, self.times, strict=True))
        n = len(ratios)
        return (
            "    step / the read pass of its repeat (per weight byte): "
            f"p10 {ratios[int(0.1 * n)]:.2f}  "
            f"p50 {statistics.median(ratios):.2f}  p90 {ratios[min(n - 1, int(0.9 * n))]:.2f}"
        )

    def best_rate(self) -> float:
        """Bytes per second of the fastest pass between the steps."""
        return self.buf.numel() * 4 / min(self.times)

    def summary(self) -> str:
        nbytes = self.buf.numel() * 4
        return (
            f"read loop ({self.loop}) over {nbytes / 1e9:.2f} GB, between the steps: best "
            f"{min(self.times) * 1e3:.1f} ms ({self.best_rate() / 1e9:.1f} GB/s), median "
            f"{nbytes / statistics.median(self.times) / 1e9:.1f} GB/s; the roofline reads at "
            f"the best rate of the run"
        )

    def report(self) -> str:
        return self.summary() + "\n" + spread(self.times, self.events)


def batch_ratios(
    cases: dict[str, tuple[ForwardInput, int, float, float]],
    times: dict[str, list[float]],
    machine: Machine,
    dtype: str,
) -> str:
    """Each decode batch's best step over the smallest batch's, next to the same ratio of their
    roofline floors: how much of a larger batch's cost this machine's bandwidth and FMA rate
    make unavoidable."""
    decodes = [name for name in cases if name.startswith("decode ")]
    if len(decodes) < 2:
        return ""
    first = decodes[0]
    base_floor = machine.floor_s(cases[first][2], cases[first][3], dtype)[0]
    lines = []
    for name in decodes[1:]:
        floor = machine.floor_s(cases[name][2], cases[name][3], dtype)[0]
        lines.append(
            f"{name} / {first}: {min(times[name]) / min(times[first]):.2f}x "
            f"(their roofline floors: {floor / base_floor:.2f}x)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
