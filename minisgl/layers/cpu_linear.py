"""CPU matmuls y = x @ W.T, by whichever implementation is fastest on this machine.

`F.linear` on CPU streams weights at a fraction of memory bandwidth for small batches (MKL's
small-M path, and torch's bf16 path without native bf16), while for prefill-sized inputs
MKL or oneDNN may beat our kernels (AVX-512, AMX). Which one wins depends on the CPU, the
shape, the dtype and the row count, so it is measured (kernel_choice.py keeps the bookkeeping):
the candidates
- "gemv": our AVX2 GEMV (cpu_kernels.py; weights streamed once, fp32 compute);
- "gemv512": our AVX-512 GEMV (native bf16 dot products where the CPU has them);
- "amx": our AMX matmul (bf16 tiles, any row count, the weight as loaded: csrc/amx.c);
- "gemm": our blocked GEMM (fp32 compute from bf16 or fp32 weights, no weight copy);
- "torch": plain F.linear (MKL for fp32);
- "panel": our matmul from bf16 weights repacked into panels (any row count): on AVX2,
  16-column panels and fp32 FMAs (csrc/panel.c); on AVX-512, 32-column panels with K in pairs
  (csrc/panel512.c), native bf16 dot products for bf16 x where the CPU has AVX512-BF16, else
  16-lane fp32 FMAs;
- "onednn": oneDNN with the weight reordered once into its blocked layout;
are timed per distinct weight shape and dtype for each row-count bucket at start-up, and a
layer then dispatches on its input's row count with a list lookup.

Weights once: the first five read the weight as loaded ("row" layout), panel and oneDNN read
their own layout of it. By default a layer keeps one layout, the one whose candidates are
least slow over all the row counts against the best of all (kernel_choice.single_layout), and
the others are dropped: no second copy of any weight. EngineArgs.cpu_weight_copies_max_gb lets
layers keep a second layout where it buys enough (kernel_choice.copy_worth), most speed per
byte first, up to that many GB; the start-up log line says what the copies take and buy, or
what they would have bought.

Tuning modes (EngineArgs.cpu_kernel_tuning): "cached" (default: measure shapes the on-disk
cache lacks), "full" (measure all again), "off" (no timing: GEMV up to 16 rows, then our
GEMM; oneDNN instead where the CPU multiplies bf16 natively and copies are allowed; where AMX
runs, AMX from 2 rows on; on AVX-512 without AMX, bf16 weights on panel512.c's panels for
every row count).
Switches: MINISGL_CPU_PREPACK=0: plain F.linear everywhere; MINISGL_CPU_KERNELS=0: no C
kernels; MINISGL_CPU_ONEDNN_GEMM=0: never a oneDNN copy; MINISGL_CPU_AMX=0: no AMX candidate;
MINISGL_CPU_LINEAR=<candidate>: that candidate for every row count where it can run (the parity
tests force each in turn).

For other layers (e.g. a fused MoE): `CpuLinearKernel.create(W)` gives a callable
x [M, K] -> x @ W.T, tuned once per shape per process; `create_group` does a list of
same-shaped weights at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from minisgl import hugepages
from minisgl.cache import cache_dir
from minisgl.layers import cpu_build, cpu_kernels, kernel_choice
from minisgl.layers.kernel_choice import (
    BUCKETS,
    LAYOUT,
    LAYOUTS,
    TIMED_ROWS,
    CopyOption,
    MachineKey,
    ShapeKey,
    Timings,
)

logger = logging.getLogger(__name__)

# Listed with the copy-free ones first: ties go to the earlier one.
CANDIDATES = ("gemv", "gemv512", "amx", "gemm", "torch", "panel", "onednn")
# Timing: at least this many bytes of distinct weights per pass (a step reads many weights in
# turn; each pass is also flushed out of the caches first, _cooler), at most this many FLOPs.
_COLD_BYTES = 48 << 20
_PASS_FLOPS = 4e8
# The least output columns per thread a timing slice keeps (_timing_set): 8 of panel.c's
# 16-column panels each (4 of panel512.c's 32-column ones).
_SLICE_ROWS_PER_THREAD = 128
# Passes per candidate: at least _MIN_REPEATS, more (up to _MAX_REPEATS) while some best still
# improves by over 2%: on an idle machine that stops early, on a busy one it keeps looking for
# undisturbed passes.
_MIN_REPEATS = 3
_MAX_REPEATS = 8

# What the chooser found in this process, by (mode, shape, candidates available, machine key).
_MEMO: dict[tuple[str, ShapeKey, tuple[str, ...], MachineKey], Plan] = {}


def _off(name: str) -> bool:
    return os.environ.get(name, "1") in ("0", "false", "no")


def prepack_enabled() -> bool:
    return not _off("MINISGL_CPU_PREPACK")


def native_bf16() -> bool:
    """The CPU has bf16 dot-product instructions and oneDNN may use them (its fast bf16 path).
    CPUID alone is not enough: ONEDNN_MAX_CPU_ISA can hold oneDNN below them (AVX2, as when
    emulating an AVX2-only CPU), and then its bf16 matmul is refused or converted."""
    has = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(has and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_gemm_enabled() -> bool:
    return not _off("MINISGL_CPU_ONEDNN_GEMM")


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        # Probe once: some builds reorder fine but refuse the matmul for this dtype.
        _onednn_linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed)
    except (RuntimeError, AttributeError):
        return None
    return packed


def _cast(y: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


# name -> run(x, weight, packed, out_dtype). The picks were made for x in the weight's dtype
# (the model's); an x of another dtype takes a path that accepts it.
_RUN: dict[str, Callable[..., torch.Tensor]] = {
    "gemv": lambda x, w, p, o: cpu_kernels.gemv(x, w, o),
    "gemv512": lambda x, w, p, o: (
        cpu_kernels.gemv512(x, w, o) if x.dtype == w.dtype else cpu_kernels.gemv(x, w, o)
    ),
    # bf16 tiles: an x of another dtype goes in rounded to bf16, as F.linear's ("torch") does.
    "amx": lambda x, w, p, o: cpu_kernels.amx(x.to(w.dtype), w, o),
    "gemm": lambda x, w, p, o: cpu_kernels.gemm(x, w, o),
    "torch": lambda x, w, p, o: _cast(F.linear(x.to(w.dtype), w), o),
    "panel": lambda x, w, p, o: cpu_kernels.panel(x, p, o),
    "onednn": lambda x, w, p, o: _cast(_onednn_linear(x.to(p.dtype), p), o),
}


def gemv_call(name: str, x_dtype: torch.dtype, w_dtype: torch.dtype) -> list[int] | None:
    """[address, form] of the one C call a pick `name` on the row-major weight makes over
    weights of `w_dtype` for x of `x_dtype`, as _RUN runs it (gemv512 takes x of the weights'
    dtype, else it is the GEMV; amx bf16 x and weights); form 1: gemv_bf16's eight arguments
    (the last x's dtype), 0: the seven of gemv_f32 and gemv512_*, 2: amx_bf16's seven (it
    returns 0 where it computed nothing). None where it is no single call on x as it is
    (another pick; an fp32 weight's GEMV converts bf16 x first). For the calls C makes itself
    (the decode chain, a mixture's one call), on weights the pick was made for."""
    lib = cpu_kernels.load()
    if lib is None:
        return None
    if name == "amx":
        if lib.amx is None or not x_dtype == w_dtype == torch.bfloat16:
            return None
        return [ctypes.cast(lib.amx, ctypes.c_void_p).value or 0, 2]
    if name not in ("gemv", "gemv512"):
        return None
    if name == "gemv512" and x_dtype == w_dtype:
        if lib.gemv512_bf16 is None:
            return None
        fn = lib.gemv512_bf16 if w_dtype == torch.bfloat16 else lib.gemv512_f32
        return [ctypes.cast(fn, ctypes.c_void_p).value or 0, 0]
    if w_dtype == torch.bfloat16:
        return [ctypes.cast(lib.bf16, ctypes.c_void_p).value or 0, 1]
    if x_dtype == torch.float32:
        return [ctypes.cast(lib.f32, ctypes.c_void_p).value or 0, 0]
    return None


# The layout a layer may keep alone (kernel_choice.one_layout), and that a tied embedding can
# read its rows from: where it serves every row count, the original weight is dropped.
SELF_CONTAINED = "panel"
# The candidates that run on their own copy of the weight alone, and how it is made (the others
# read the weight as it is: a layer none of whose picks does needs no row-major weight).
_COPY: dict[str, Callable[[torch.Tensor], Any]] = {
    "panel": lambda w: cpu_kernels.panel_pack(w),
    "onednn": lambda w: _onednn_pack(w),
}


def pack(name: str, weight: torch.Tensor) -> Any:
    """Candidate `name`'s copy of `weight` (None for those that use the weight as it is)."""
    make = _COPY.get(name)
    return make(weight.detach().contiguous()) if make is not None else None


def available(weight: torch.Tensor, x_dtype: torch.dtype, copies: bool = True) -> list[str]:
    """The candidates that can compute x @ weight.T here (in CANDIDATES' order); `copies`:
    whether one that keeps a second copy of the weight (oneDNN's layout) may be among them."""
    ours = cpu_kernels.supports(weight)
    out = []
    if ours:
        out.append("gemv")
        if cpu_kernels.supports_gemv512(x_dtype, weight):
            cpu_kernels.measure_gemv512_rows_in_turn()
            out.append("gemv512")
        if cpu_kernels.supports_amx(x_dtype, weight):
            cpu_kernels.measure_amx_rows_to_hardware()
            out.append("amx")
        out.append("gemm")
    out.append("torch")
    if copies and ours and cpu_kernels.supports_panel(weight):
        cpu_kernels.measure_panel_few_rows_far()
        cpu_kernels.measure_panel_convert_first()
        out.append("panel")
    # oneDNN probed on a few rows of the weight (packing all of a large one takes a while).
    probe = weight.detach()[: min(weight.shape[0], 64)]
    if (
        copies
        and x_dtype == weight.dtype
        and onednn_gemm_enabled()
        and _onednn_pack(probe) is not None
    ):
        out.append("onednn")
    return out


def default_picks(avail: Sequence[str], weight_dtype: torch.dtype) -> tuple[str, ...]:
    """Without measuring (tuning "off", or timings a busy machine disturbed): the choice that
    was tuned on an AVX2 machine; where AMX runs, AMX from 2 rows on (measured on a Xeon with
    AMX: ahead of every other candidate there, and it needs no weight copy), and one row on the
    AVX-512 GEMV (there 1.25-1.35x the AVX2 one's rate, one thread, cold weights); where the
    panels are panel512.c's (AVX-512 without AMX), the panels for every row count: one
    layout, the original weight dropped (measured on a 2-core AMD EPYC Zen 4, one thread, cold
    bf16 weights: 1.5-1.6x the AVX-512 GEMV's rate at 1 row, 1.3-1.8x at 8, 1.2-1.4x at 32,
    level with oneDNN at 320; on a Xeon without AVX512-BF16, measured, the chooser's pick at
    every row count of the 0.6B shapes)."""
    if "amx" in avail:
        one = "gemv512" if "gemv512" in avail else "gemv"
        return tuple(one if last == 1 else "amx" for _, last in BUCKETS)
    if "panel" in avail and weight_dtype == torch.bfloat16 and cpu_kernels.panel_pairs():
        return tuple("panel" for _ in BUCKETS)
    if "gemv" in avail:
        native = weight_dtype == torch.bfloat16 and native_bf16() and "onednn" in avail
        big = "onednn" if native else "gemm"
        small = cpu_kernels.MAX_ROWS
        return tuple("gemv" if (last or small + 1) <= small else big for _, last in BUCKETS)
    only = "onednn" if "onednn" in avail else "torch"
    return tuple(only for _ in BUCKETS)


def machine_key() -> MachineKey:
    model, flags = cpu_build.cpu_info()
    kernels = cpu_kernels.build_id() or "none"
    rules = kernel_choice.policy(CANDIDATES)
    return MachineKey.of(model, flags, torch.__version__, torch.get_num_threads(), kernels, rules)


def tuning_cache() -> kernel_choice.TuningCache:
    return kernel_choice.TuningCache(cache_dir() / "tuning", machine_key())


class CpuLinearKernel:
    """y = x @ weight.T (in `out_dtype`, default x's dtype), by the pick for x's row count.
    `weight` is None where no pick reads it (every one runs on its own copy)."""

    def __init__(
        self,
        weight: torch.Tensor,
        picks: Sequence[str],
        packed: Mapping[str, Any],
        out_dtype: torch.dtype | None,
    ) -> None:
        self.picks = tuple(picks)
        needed = any(name not in _COPY for name in self.picks)
        self.weight: torch.Tensor | None = weight if needed else None
        self.packed, self.out_dtype = packed, out_dtype
        runs = {name: _bind(name, self.weight, packed.get(name), out_dtype) for name in set(picks)}
        self._table = [runs[name] for name in kernel_choice.row_table(self.picks)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._table[kernel_choice.table_index(x.shape[0])](x)

    @staticmethod
    def create(
        weight: torch.Tensor, out_dtype: torch.dtype | None = None, tuning: str = "cached"
    ) -> CpuLinearKernel | None:
        """The kernel for `weight`, or None where nothing beats F.linear's plain path here."""
        return create_group([weight], out_dtype, tuning)[0]


def _bind(
    name: str, weight: torch.Tensor | None, packed: Any, out_dtype: torch.dtype | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    run = _RUN[name]
    return lambda x: run(x, weight, packed, out_dtype)


def create_group(
    weights: Sequence[torch.Tensor],
    out_dtype: torch.dtype | None = None,
    tuning: str = "cached",
    x_dtype: torch.dtype | None = None,
) -> list[CpuLinearKernel | None]:
    """Kernels for same-shaped, same-dtype weights (e.g. every layer's qkv), tuned once: the
    timing passes over several of them, so they read from memory as in a real step. Each
    weight is kept in one layout (no second copy)."""
    first = weights[0].detach()
    if not _eligible(first):
        return [None] * len(weights)
    plan = choose(weights, x_dtype or first.dtype, out_dtype, tuning)
    return _kernels(weights, plan.single(), out_dtype)


def _eligible(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and prepack_enabled()
    )


def _kernels(
    weights: Sequence[torch.Tensor], picks: tuple[str, ...] | None, out_dtype: torch.dtype | None
) -> list[CpuLinearKernel | None]:
    if picks is None:
        return [None] * len(weights)
    out: list[CpuLinearKernel | None] = []
    for w in weights:
        w = w.detach()
        packed = {name: pack(name, w) for name in set(picks) if name in _COPY}
        out.append(CpuLinearKernel(w, picks, packed, out_dtype))
    return out


@dataclass(frozen=True)
class Plan:
    """What the chooser found for one shape: its measured `timings` (None where it did not
    measure: a forced candidate, the defaults), or else the `fallback` picks; `row_defaults`:
    the defaults among the candidates on the row-major weight."""

    shape: ShapeKey
    source: str
    timings: Timings | None
    fallback: tuple[str, ...]
    row_defaults: tuple[str, ...]

    def single(self, allowed: Sequence[str] = LAYOUTS) -> tuple[str, ...] | None:
        """Picks on one layout of the weight (among `allowed`); None: plain F.linear."""
        if self.timings is not None:
            try:
                picks = kernel_choice.single_layout(self.timings, self.row_defaults, allowed)
            except ValueError:  # the allowed layouts' candidates were all dropped as hopeless
                picks = self.row_defaults  # somewhere: they still run, the defaults among them
        elif len(layouts := kernel_choice.layouts_of(self.fallback)) == 1 and layouts[0] in allowed:
            picks = self.fallback
        else:
            picks = self.row_defaults
        return None if all(p == "torch" for p in picks) else picks

    def full(self) -> tuple[str, ...] | None:
        """The fastest picks per bucket, with a second layout wherever it is worth one."""
        if self.timings is None:
            picks = self.fallback
        else:
            best = kernel_choice.pick(self.timings, self.row_defaults)
            picks = kernel_choice.one_layout(best, self.timings, SELF_CONTAINED)
        return None if all(p == "torch" for p in picks) else picks


def choose(
    weights: Sequence[torch.Tensor],
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    tuning: str,
    copies: bool = True,
) -> Plan:
    """Measure (or recall) the candidates for these weights' shape; `copies`: as for
    `available` (a mixture's experts are never copied: twice their memory)."""
    if tuning not in kernel_choice.MODES:
        raise ValueError(f"cpu_kernel_tuning must be one of {kernel_choice.MODES}, not {tuning!r}")
    first = weights[0]
    shape = ShapeKey(
        first.shape[0],
        first.shape[1],
        str(first.dtype).removeprefix("torch."),
        str(x_dtype).removeprefix("torch."),
        str(out_dtype or x_dtype).removeprefix("torch."),
    )
    avail = available(first, x_dtype, copies)
    defaults = default_picks(avail, first.dtype)
    row = default_picks([a for a in avail if LAYOUT[a] == "row"], first.dtype)
    forced = os.environ.get("MINISGL_CPU_LINEAR")
    if forced:
        return Plan(shape, "forced", None, kernel_choice.forced(forced, avail, defaults), row)
    if tuning == "off":
        return Plan(shape, "defaults", None, defaults, row)
    # keyed as the cache is: another thread count within a process times again
    memo = (tuning, shape, tuple(avail), machine_key())
    if memo in _MEMO:
        return _MEMO[memo]
    cache = tuning_cache()
    got = cache.get(shape, avail) if tuning == "cached" else None
    if got is not None:
        plan = Plan(shape, "cached", got, defaults, row)
    else:
        spreads: list[float] = []
        others = kernel_choice.OtherWork()
        timings = measure(weights, x_dtype, out_dtype, avail, spreads=spreads)
        plan = Plan(shape, "measured", timings, defaults, row)
        if kernel_choice.disturbed(spreads):
            # Bursts of other work decide such timings more than the kernels do.
            plan = Plan(shape, "defaults: timings disturbed, not cached", None, defaults, row)
            logger.warning(
                "CPU matmul timings for %s varied by %.1fx between passes (other work on "
                "the cores): using the defaults, measuring again next start",
                shape,
                sorted(spreads)[len(spreads) // 2],
            )
        elif (share := others.share()) > kernel_choice.OTHER_WORK_LIMIT:
            # A steady load: the picks are the best we know now, but not for a quiet start.
            plan = Plan(shape, "measured beside other work", timings, defaults, row)
            logger.warning(
                "CPU matmul timings for %s taken while other processes used %.0f%% of the "
                "cores: not cached, measuring again next start",
                shape,
                100 * share,
            )
        else:
            cache.put({shape: {n: timings[n] for n in avail}})
    _MEMO[memo] = plan
    return plan


def _timing_set(weights: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """The weights one timing pass multiplies: enough distinct ones to miss the caches, few
    enough FLOPs to stay quick (a slice of rows of one when even one is too big). A slice keeps
    _SLICE_ROWS_PER_THREAD output columns per thread at least: split over the threads as the
    whole weight is (a 64-column slice is 4 panels for 2 threads: a 1024-row pass then timed
    the kernels' fork, joins and x conversion more than their FMAs, and 2 threads ran it
    slower than 1)."""
    n, k = weights[0].shape
    per = weights[0].numel() * weights[0].element_size()
    flops = 2.0 * rows * n * k
    count = max(1, min(len(weights), -(-_COLD_BYTES // per), int(_PASS_FLOPS // flops)))
    if flops <= _PASS_FLOPS:
        return [w.detach() for w in weights[:count]]
    wide = _SLICE_ROWS_PER_THREAD * torch.get_num_threads()
    keep = max(64, wide, int(_PASS_FLOPS // (2.0 * rows * k)) // 16 * 16)
    return [weights[0].detach()[: min(n, keep)]]


def _cooler(tensors: Sequence[torch.Tensor]) -> Callable[[], object] | None:
    """What runs before each timed pass so the pass reads `tensors` (its weights and copies)
    from memory as a decode step does, not from a cache an earlier pass filled (where the
    weights stream in during the FMAs, a warm set hides that cost): their lines flushed out of
    every cache level (cpu_kernels.flush), whatever the size of the last-level cache: a pass
    over 48 MB ran from a Xeon VM's 480 MB L3 at ~1.9x a step's rate and ranked the kernels by
    their arithmetic. oneDNN's reordered weight has no address to flush (an opaque tensor):
    before its passes, a read of other memory larger than the last-level cache (_evict_bytes).
    Without the kernels, where the set is smaller than _COLD_BYTES, a read of _COLD_BYTES of
    other memory (last-level caches of up to ~32 MB); None: nothing to do."""
    plain = [t for t in tensors if t.layout == torch.strided]
    opaque = len(plain) < len(tensors)
    lib = cpu_kernels.load()
    if lib is not None and not opaque:
        return lambda: cpu_kernels.flush(tensors)
    size = _evict_bytes() if opaque else _COLD_BYTES
    if not opaque and sum(t.numel() * t.element_size() for t in tensors) >= size:
        return None
    buf = _other_memory(size)
    if lib is None:
        return lambda: float(buf.sum())
    return lambda: (cpu_kernels.flush(plain), lib.stream_read(buf.data_ptr(), buf.numel()))


def _last_level_cache() -> int:
    """Bytes of the largest cache Linux reports for CPU 0 (0: none reported)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):
            continue
    return max(sizes)


def _evict_bytes() -> int:
    """Other memory read to push a tensor that cannot be flushed out of the caches: a quarter
    more than the last-level cache. On a Xeon VM (480 MB L3), oneDNN's 32-row matmul on its
    6144x1024 bf16 copy after a flush of the original weight (its copy left in L3) ran 1.07-1.37x
    our AMX kernel's speed, after a read of 600 MB 0.60-0.70x; in a B=32 decode step it took
    26.9 ms against AMX's 15.5, where the warm timing had made it the pick for 9-512 rows."""
    return max(_COLD_BYTES, _last_level_cache() * 5 // 4)


# The other memory of _cooler's reads by size, shared by the candidates' coolers while a
# measure() runs (up to a last-level cache and a quarter: freed when it ends).
_OTHER: dict[int, torch.Tensor] = {}


def _other_memory(size: int) -> torch.Tensor:
    if size not in _OTHER:
        # its own mapping, unmapped when dropped; written, so its pages are distinct memory
        _OTHER[size] = hugepages.empty(size // 4, dtype=torch.float32).fill_(1.0)
    return _OTHER[size]


def _pass_tensors(group: Sequence[torch.Tensor], packed: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors a candidate's pass reads: the weights and its copies of them (pack: the
    panels' data, oneDNN's reordered tensor, or none)."""
    copies = [p.data if isinstance(p, cpu_kernels.PanelWeight) else p for p in packed]
    return list(group) + [t for t in copies if isinstance(t, torch.Tensor)]


def _timed_pass(
    kernel: tuple[Callable[..., torch.Tensor], list[Any]],
    evict: Callable[[], object] | None,
    group: Sequence[torch.Tensor],
    x: torch.Tensor,
    out_dtype: torch.dtype | None,
    clock: Callable[[], float],
) -> float:
    """Seconds of one pass of a candidate (its run and its copies of `group`) over the group,
    its tensors evicted first."""
    run, packed = kernel
    if evict is not None:
        evict()
    t0 = clock()
    for w, p in zip(group, packed):
        run(x, w, p, out_dtype)
    return clock() - t0


def measure(
    weights: Sequence[torch.Tensor],
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    avail: Sequence[str],
    clock: Callable[[], float] = time.perf_counter,
    spreads: list[float] | None = None,
) -> dict[str, list[float | None]]:
    """Seconds per pass for each candidate (in CANDIDATES' order) and bucket; None: cannot
    run here. The candidates take turns pass by pass and each keeps its best, so a burst of
    other work on the machine hits them all alike; one far behind after kernel_choice.DROP_AFTER
    passes is not run again (except the panels, SELF_CONTAINED), and the leader and those
    within reach of it take more passes in turn (kernel_choice.contenders). The best pass
    counts (other work only ever adds time). Every pass reads its weights from memory
    (_timing_set, _cooler), as a step does. `spreads` collects each repeated candidate's
    slowest pass over its fastest."""
    try:
        return _measure(weights, x_dtype, out_dtype, avail, clock, spreads)
    finally:
        _OTHER.clear()


def _measure(
    weights: Sequence[torch.Tensor],
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    avail: Sequence[str],
    clock: Callable[[], float],
    spreads: list[float] | None,
) -> dict[str, list[float | None]]:
    timings: dict[str, list[float | None]] = {name: [] for name in CANDIDATES}
    packs: dict[tuple[str, int, int], Any] = {}
    for rows in TIMED_ROWS:
        group = _timing_set(weights, rows)
        x = torch.randn(rows, group[0].shape[1]).to(x_dtype)
        live: dict[str, tuple[Callable[..., torch.Tensor], list[Any]]] = {}
        cool: dict[str, Callable[[], object] | None] = {}
        for name in CANDIDATES:
            if name not in avail:
                continue
            for i, w in enumerate(group):
                if (name, i, w.shape[0]) not in packs:
                    packs[(name, i, w.shape[0])] = pack(name, w)
            packed = [packs[(name, i, w.shape[0])] for i, w in enumerate(group)]
            live[name] = (_RUN[name], packed)
            cool[name] = _cooler(_pass_tensors(group, packed))
            _RUN[name](x, group[0], packed[0], out_dtype)  # warm-up: first-call set-up
        best = {name: float("inf") for name in live}
        worst = {name: 0.0 for name in live}
        for rep in range(_MAX_REPEATS):
            improved = False
            for name in live:
                t = _timed_pass(live[name], cool[name], group, x, out_dtype, clock)
                improved |= t < 0.98 * best[name]
                best[name] = min(best[name], t)
                worst[name] = max(worst[name], t)
            if rep + 1 == kernel_choice.DROP_AFTER:
                lead = min(best.values())
                # The panels stay: a layout's only candidate, dropped on disturbed passes it
                # would lose the weight's layout for every row count on those passes alone.
                behind = kernel_choice.DROP_BEHIND * lead
                live = {n: v for n, v in live.items() if best[n] <= behind or n == SELF_CONTAINED}
            elif rep + 1 >= _MIN_REPEATS and not improved:
                break
        again = kernel_choice.contenders({n: best[n] for n in live})
        for _ in range(kernel_choice.CONFIRM_REPEATS if len(again) > 1 else 0):
            for name in again:
                t = _timed_pass(live[name], cool[name], group, x, out_dtype, clock)
                best[name] = min(best[name], t)
        for name in CANDIDATES:
            timings[name].append(best.get(name))
        if spreads is not None:
            spreads += [worst[n] / best[n] for n in live if best[n] > 0]
    return timings


def row_runner(
    weights: Sequence[torch.Tensor], tuning: str = "cached"
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, str, list[str]]:
    """For many same-shaped weights used one at a time (a mixture's experts): run(x, w) -> x @
    w.T by the copy-free candidate measured fastest for x's row count (None where plain
    F.linear wins everywhere or nothing else runs here), a one-line summary of the picks, and
    the pick's name per row count (kernel_choice.row_table; empty where run is None)."""
    first = weights[0]
    if not _eligible(first):
        return None, "", []
    plan = choose(weights, first.dtype, None, tuning, copies=False)
    picks = plan.single()
    if picks is None:
        return None, "", []
    names = kernel_choice.row_table(picks)
    table = [_RUN[name] for name in names]

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return table[kernel_choice.table_index(x.shape[0])](x, w, None, None)

    return run, kernel_choice.summary({plan.shape: picks}, plan.source), names


def prepack_modules(
    modules: Sequence[Any],
    tuning: str = "cached",
    shared: Collection[int] = (),
    lookup: Collection[int] = (),
    copies_max_bytes: int = 0,
) -> None:
    """Set `m.kernel` for CPU matmul modules (each has `weight` and `kernel_out_dtype`), tuning
    once per distinct shape and dtype, and log one line of what was picked.

    Each weight is kept in one layout, the one whose candidates are measured best over the
    row counts, unless `copies_max_bytes` allows second layouts: they go to the shapes they
    speed up most per byte, while they fit. A module whose kernel never reads its weight gets a
    weight on the meta device (shape and dtype, no memory) unless the weight's id is in
    `shared` (read elsewhere too, so its row-major layout stays and is the one kept); a weight
    in `lookup` (a tied embedding reads rows of it) is kept in a layout rows can be read from
    (row-major or panels)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for m in modules:
        w = m.weight
        if _eligible(w):  # timed and kept on the pages it will be streamed from
            hugepages.move_onto(w)
        # The layouts it may be kept in alone: a weight read elsewhere keeps its row-major
        # one, which is then the one; rows are read from the row-major weight or the panels.
        allowed = ("row",) if id(w) in shared else ("row", "panel") if id(w) in lookup else LAYOUTS
        key = (tuple(w.shape), w.dtype, m.kernel_out_dtype, allowed)
        groups.setdefault(key, []).append(m)
    cpu_kernels.load()  # a first start compiles the kernels here: logged on its own
    t0 = time.perf_counter()
    plans: list[tuple[list[Any], Plan | None]] = []
    options: list[CopyOption] = []
    for (_, _, out_dtype, allowed), mods in groups.items():
        first = mods[0].weight.detach()
        plan = (
            choose([m.weight for m in mods], first.dtype, out_dtype, tuning)
            if _eligible(first)
            else None
        )
        plans.append((mods, plan))
        options.append(_copy_option(mods, plan, allowed))
    granted = kernel_choice.allot_copies(options, copies_max_bytes)
    chosen: dict[ShapeKey, tuple[str, ...]] = {}
    sources: set[str] = set()
    extra = 0
    for (mods, plan), option, copy in zip(plans, options, granted):
        picks = option.full if copy else option.single
        if plan is None or not picks:
            for m in mods:
                m.kernel = None
            continue
        kernels = _kernels([m.weight for m in mods], picks, mods[0].kernel_out_dtype)
        for m, kernel in zip(mods, kernels):
            m.kernel = kernel
            assert kernel is not None
            extra += sum(_nbytes(p) for p in kernel.packed.values())
            if kernel.weight is None and id(m.weight) not in shared:
                extra -= _nbytes(m.weight)
                m.weight = torch.nn.Parameter(m.weight.to("meta"), requires_grad=False)
        chosen[plan.shape] = picks
        sources.add(plan.source)
    if chosen:
        how = "/".join(sorted(sources)) + f", {time.perf_counter() - t0:.1f} s"
        logger.info(
            kernel_choice.summary(chosen, how)
            + _copies_note(plans, options, granted, extra, copies_max_bytes)
        )


def _copy_option(mods: Sequence[Any], plan: Plan | None, allowed: Sequence[str]) -> CopyOption:
    """Picks on one layout (among `allowed`) and with copies for a group of same-shaped
    modules, and what the second layouts would cost and buy."""
    if plan is None:
        return CopyOption((), (), 0, 0.0)
    single, full = plan.single(allowed), plan.full()
    if single is None or full is None or full == single:
        return CopyOption(single or (), single or (), 0, 0.0)
    kept = set(kernel_choice.layouts_of(full))
    if not kept & set(allowed):  # e.g. all oneDNN for a tied head: its table stays too
        kept.add("row")
    extra = (len(kept) - 1) * _nbytes(mods[0].weight) * len(mods)
    if plan.timings is None:  # the defaults (or a forced candidate): kept where they fit
        return CopyOption(single, full, extra, 1e-9)
    if not kernel_choice.copy_worth(single, full, plan.timings):
        return CopyOption(single, single, 0, 0.0)
    gain = kernel_choice.slowdown(single, plan.timings) - kernel_choice.slowdown(full, plan.timings)
    return CopyOption(single, full, extra, gain)


def _copies_note(
    plans: Sequence[tuple[list[Any], Plan | None]],
    options: Sequence[CopyOption],
    granted: Sequence[bool],
    extra: int,
    budget: int,
) -> str:
    """What second weight copies take and buy, or what they would have bought."""
    kept: list[str] = []
    left: list[str] = []
    for (_, plan), option, copy in zip(plans, options, granted):
        if plan is None or option.extra_bytes == 0 or option.full == option.single:
            continue
        what = f"{plan.shape.n}x{plan.shape.k} {option.extra_bytes / 2**20:.0f} MiB"
        if plan.timings is not None:
            what += f" ({kernel_choice.speedups(option.single, option.full, plan.timings)})"
        (kept if copy else left).append(what)
    cap = f"--cpu-weight-copies-max-gb {budget / 2**30:g}"
    note = ""
    if extra > 2**20:
        note += f"; second weight copies: {extra / 2**20:.0f} MiB"
    if kept:
        note += f" for {', '.join(kept)}"
    if left:
        note += f"; one layout per weight ({cap}): copies not kept: {', '.join(left)}"
    return note


def _nbytes(packed: Any) -> int:
    data = getattr(packed, "data", packed)  # a PanelWeight, or oneDNN's tensor
    try:
        return int(data.numel() * data.element_size())
    except (AttributeError, RuntimeError):  # an opaque layout that does not say
        return 0
