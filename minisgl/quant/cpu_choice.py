"""Which CPU matmul runs a quantized weight for which row count: measured, as for float
weights (layers/cpu_linear.py, with kernel_choice.py's buckets, picks and tuning cache).

The candidates (cpu_gemv.py), all reading the quantized weight as loaded (no second copy):
- "qgemv": the codes widened in registers, each byte read once per call; decode's pick;
- "dequant_gemm": a chunk of rows dequantized once into fp32, then our fp32 GEMM;
- "dequant_torch": the same chunk multiplied by torch's fp32 matmul (MKL / oneDNN);
- "dequant_panel": 16 rows at a time dequantized once into a register tile's layout, for all
  input rows (cpu_panel.py);
- "int16_panel": the same with integer codes against x quantized per row to int16 (VPMADDWD);
- "amx_panel": a panel dequantized once into bf16 and multiplied on AMX tiles, or by
  VDPBF16PS where the CPU has AVX512-BF16 and no AMX (bf16 x; where the CPU and build have
  neither, or x is fp32, it runs dequant_panel);
- "amx_int": few rows on AMX tiles straight from the codes, a weight byte costing the same
  work for 1 to 16 rows (cpu_panel.py): integer codes as AMX-INT8 tiles against x quantized
  per row to int16 (qgemv's numerics), fp8 codes converted exactly to bf16 against bf16 x
  (fp32 x, and CPUs or builds without the tiles, run qgemv);
- "x8_panel": many rows of x rounded to 8 bits against integer codes with AVX512-VNNI
  (cpu_panel.py): offered only under --cpu-quantized-activations int8 (it changes the
  numerics), for weights its kernel takes;
- "vnni_panel": integer codes repacked once into 32-row panels, any row count, with
  AVX512-VNNI (cpu_vpanel.py): exact (int16 x), or under --cpu-quantized-activations int8
  x rounded to 8 bits as x8_panel rounds it (the same bits). Its layout replaces the
  row-major codes, so it is all or nothing for a weight: it serves every row count where it is
  less slow on average over the buckets than the row-major candidates' picks (as the float
  weights' one layout, kernel_choice.single_layout); offered for dense weights (a tied
  embedding table too: its lookups gather rows out of the panels) and a mixture's experts
  (packed a run of them at a time). Timed on packed copies of the timing set;
- "amx_vpanel": the same panels on AMX-INT8 tiles, the same bits (cpu_vpanel.py; exact x or
  x in 8 bits, as vnni_panel), where the CPU and build have them: the packed layout's kernel
  for the row counts it runs faster (on an AMX Xeon 8-bit codes from 2 rows, 4-bit from 5-9),
  vnni_panel's for the others;
- "amx_bf16_vpanel": the same panels dequantized once per call into bf16 and multiplied by bf16
  x (amx_panel's kernel and values, over the packed layout): the packed layout's prefill. Both
  take a weight's group mins into the panel from cpu_panel.FOLD_MINS_ROWS rows.
A weight with group mins is timed as its layer runs it (cpu_panel.run_mins): each pick's
kernel, then the mins' term, or the kernel that folds them into its panel.
MINISGL_CPU_QUANT_LINEAR=<candidate> forces one everywhere it can run (tests, benchmarks).
Which wins at which row count depends on the CPU (FMA width, integer multiply rate, MKL), so
nothing is a fixed row limit: each shape and code kind is timed per bucket at start-up, or read
from the cache. Tuning "off": qgemv for one row, amx_int for 2 to cpu_kernels.MAX_ROWS where
its tiles run (AMX-INT8; fp8 codes: AMX-BF16 with bf16 x; qgemv elsewhere), then amx_panel
where AMX or AVX512-BF16 runs it, else dequant_panel; under --cpu-quantized-activations int8
qgemv (rounding x) up to its rows, then x8_panel where the build has it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from minisgl.cache import cache_dir
from minisgl.layers import cpu_build, cpu_kernels, kernel_choice
from minisgl.layers.kernel_choice import BUCKETS, TIMED_ROWS, MachineKey, ShapeKey
from minisgl.quant import cpu_gemv, cpu_panel, cpu_vpanel
from minisgl.quant.qtensor import QTensor, streamed

logger = logging.getLogger(__name__)

CANDIDATES = (
    "qgemv",
    "dequant_gemm",
    "dequant_torch",
    "dequant_panel",
    "int16_panel",
    "amx_panel",
    "amx_int",
    "x8_panel",
    "vnni_panel",
    "amx_vpanel",
    "amx_bf16_vpanel",
)
# The candidates over repacked weights: the layout serves all buckets or none (see the top);
# PACKED, its VNNI kernel, runs every row count and names the layout.
PACKED = "vnni_panel"
PACKED_KERNELS = (PACKED, "amx_vpanel", "amx_bf16_vpanel")


class Run(Protocol):
    def __call__(
        self, x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...


_RUN: dict[str, Run] = {
    "qgemv": cpu_gemv.qgemv,
    "dequant_gemm": cpu_gemv.dequant_gemm,
    "dequant_torch": cpu_gemv.dequant_torch,
    "dequant_panel": cpu_panel.dequant_panel,
    "int16_panel": cpu_panel.int16_panel,
    "amx_panel": cpu_panel.amx_panel,
    "amx_int": cpu_panel.amx_int,
    "x8_panel": cpu_panel.x8_panel,
}
# What packed weights run for a pick of each packed candidate; timed on packed copies.
_PACKED_RUN: dict[str, Run] = {
    PACKED: cpu_vpanel.vnni_panel,
    "amx_vpanel": cpu_vpanel.amx_vpanel,
    "amx_bf16_vpanel": cpu_vpanel.amx_bf16_vpanel,
}
_RUN.update({name: cpu_vpanel.on_copy(run) for name, run in _PACKED_RUN.items()})
# Timing passes: as cpu_linear's (weights flushed from the caches, bounded FLOPs, best of a few
# interleaved).
_COLD_BYTES = 48 << 20
_PASS_FLOPS = 4e8
_MIN_REPEATS, _MAX_REPEATS = 3, 8
_MEMO: dict[tuple[str, ShapeKey, MachineKey, bool], tuple[tuple[str, ...], str]] = {}


class QuantKernel:
    """run(x, w) -> x @ w.T for quantized weights of one shape, by the pick for x's rows."""

    def __init__(self, picks: Sequence[str]) -> None:
        self.picks = tuple(picks)
        self._table = [
            _PACKED_RUN.get(name) or _RUN[name] for name in kernel_choice.row_table(self.picks)
        ]

    def __call__(
        self, x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """In `out_dtype` (default x's), written by the kernel itself: a float32 LM head's
        logits are the kernel's fp32 sums, not sums rounded to bf16 and widened."""
        run = self._table[kernel_choice.table_index(x.shape[0])]
        return run(x, w) if out_dtype is None else run(x, w, out_dtype)

    def pick(self, rows: int) -> str:
        """The pick that runs `rows` rows of x."""
        return kernel_choice.row_table(self.picks)[kernel_choice.table_index(rows)]


def kernel_fn(lib: Any, name: str, kind: str, x_bf16: int) -> Any | None:
    """The C function (a ctypes function of `lib`, cpu_kernels.load()) that quantized pick
    `name` calls for codes of `kind` (cpu_gemv.kind), all taking qgemv's arguments, by the
    rules of its wrapper in cpu_gemv.py / cpu_panel.py; None where the pick is no single C
    call (dequant_gemm / dequant_torch: chunks dequantized from Python, a GEMM call each). For
    the calls C makes itself (the decode chain, a mixture's one call)."""
    if name == "qgemv":
        return lib.qgemv[kind]
    if name == "dequant_panel":
        return lib.qpanel[kind]
    if name == "int16_panel":
        return lib.qpanel16.get(kind) or lib.qpanel[kind]
    if name == "amx_panel":
        return (lib.qamx.get(kind) if x_bf16 else None) or lib.qpanel[kind]
    if name == "amx_int":
        fn = lib.qamxi.get(kind)
        return lib.qgemv[kind] if fn is None or (kind == "fp8" and not x_bf16) else fn
    if name == "x8_panel" and kind in lib.qvnni:  # picked only for weights it takes
        return lib.qvnni[kind]
    if name == PACKED and kind in lib.qvpanel:  # picked only for packed weights
        return lib.qvpanel[kind]
    if name == "amx_vpanel":
        return lib.qvpanel_amx.get(kind)
    if name == "amx_bf16_vpanel":  # vnni_panel's for fp32 x, as its wrapper
        return (lib.qamx_packed.get(kind) if x_bf16 else None) or lib.qvpanel.get(kind)
    return None


def takes_groups_of_16() -> bool:
    """Whether this build's kernels run 8-bit codes in groups of 16 (GGUF's Q6_K, Q3_K, Q2_K):
    the VNNI panels alone where the build has them (the AVX-512 build on a CPU with
    AVX512-VNNI), else qgemv and the dequantizing kernels (models/gguf.py holds such weights
    only then)."""
    return cpu_vpanel.takes_groups_of_16() or cpu_gemv.takes_groups_of_16()


def default_picks(
    kind: str | None = None, x_dtype: torch.dtype = torch.bfloat16, x8: bool = False
) -> tuple[str, ...]:
    """Untuned: qgemv for one row; for few rows amx_int where this build and CPU have its
    tiles for codes of `kind` (cpu_gemv.kind; None: any integer codes) and x of `x_dtype`
    (fp8 codes: bf16 x only), else qgemv; then the panel on AMX tiles where this build and CPU
    have them (it runs the fp32 panel for fp32 x), else the fp32 panel. `x8` (4-bit weights
    under --cpu-quantized-activations int8): qgemv, which then rounds x, for every row count it
    rounds x in (0.65-0.86x the fp32 panel's time at 17-64 rows on an AVX2 EPYC VM). Where the
    bf16 panel runs on AVX512-BF16 without AMX, fp8 and 4-bit codes take it for fewer rows
    (see below). `x8` where the build has qvnni.c (AVX512-VNNI): x8_panel past qgemv's rows
    (8-bit x with VPDPBUSD, prefill included), without AMX tiles from fewer rows (below)."""
    small = max(cpu_kernels.MAX_ROWS, cpu_kernels.x8_gemv_rows() if x8 else 0)
    lib = cpu_kernels.load()
    many = "amx_panel" if lib is not None and lib.qamx else "dequant_panel"
    x8_panel = x8 and lib is not None and bool(lib.qvnni) and (kind is None or kind in lib.qvnni)
    if x8_panel:
        many = "x8_panel"
    if kind is None:
        tiles = lib is not None and bool(lib.qamxi.keys() - {"fp8"})
    else:
        tiles = lib is not None and kind in lib.qamxi
        tiles = tiles and (kind != "fp8" or x_dtype == torch.bfloat16)
    # amx_int multiplies x in 16 bits: under `x8` the rows qgemv rounds x for stay qgemv's.
    few = "amx_int" if tiles and not x8 else "qgemv"
    # AVX512-BF16 and no AMX tiles (AMD Zen 4): the bf16 panel (amx_panel) beats the GEMV's
    # conversions at fewer rows for fp8 (from 5) and 4-bit codes (from 9); 8-bit codes keep
    # the GEMV's VPDPBUSD up to `small` (1 thread, CPU time, Qwen3-0.6B shapes: fp8 at 8 rows
    # 1.3-1.6x, 4-bit at 16 rows 1.2-1.3x faster than qgemv).
    panel_from = None
    if lib is not None and lib.qamx and not lib.qamxi and x_dtype == torch.bfloat16 and not x8:
        panel_from = {"fp8": 5, "u4": 9}.get(kind or "")
    # x8_panel without AMX tiles (AMD Zen 4): ahead of the GEMV's 8-bit x from 5 rows for
    # 4-bit codes (8 rows 0.43-0.61x bf16's time against qgemv's 0.45-0.87x) and from 33 for
    # 8-bit codes (16 rows: qgemv 0.38-0.59x, x8_panel 0.49-0.54x; 32 rows about even; 64 rows
    # 0.50-0.59x against 0.57-0.68x); 1 thread, CPU time, hot weights, Qwen3-0.6B shapes.
    if x8_panel and lib is not None and not lib.qamxi:
        panel_from = {"u4": 5, "u8": 33}.get(kind or "")
    return tuple(
        ("qgemv" if last == 1 else few)
        if (last or small + 1) <= small and (panel_from is None or first < panel_from)
        else many
        for first, last in BUCKETS
    )


def offered(
    weights: Sequence[QTensor], packable: bool = False, x_dtype: torch.dtype = torch.bfloat16
) -> tuple[str, ...]:
    """The candidates timed for these weights: int16_panel for groups of 32n only; x8_panel
    only under --cpu-quantized-activations int8 and where its kernel takes them (outside that
    mode it would change the numerics);
    vnni_panel only where the weights may be repacked (`packable`) and its kernel takes them
    (under int8 activations it rounds x as x8_panel does; fp8 codes: bf16 x only), its AMX
    forms beside it where their kernels run here (amx_vpanel: integer codes, exact or 8-bit
    x as vnni_panel; amx_bf16_vpanel: bf16 x)."""
    x8 = cpu_kernels.quantized_activations() == "int8" and cpu_panel.x8_takes(weights[0])
    packed = packable and cpu_vpanel.takes(weights[0], x_dtype)
    extra = {
        # its runs of 32 features: not groups of 16 (which usable takes in some builds)
        "int16_panel": (weights[0].group_size or weights[0].in_features) % 32 == 0,
        "x8_panel": x8,
        PACKED: packed,
        "amx_vpanel": packed and cpu_vpanel.takes_amx(weights[0]),
        "amx_bf16_vpanel": packed and cpu_vpanel.takes_bf16(weights[0], x_dtype),
    }
    return tuple(c for c in CANDIDATES if extra.get(c, True))


def one_layout(timings: kernel_choice.Timings, defaults: Sequence[str]) -> tuple[str, ...]:
    """The picks over the row-major codes (per bucket, as kernel_choice.pick), or the packed
    layout's in every bucket (the fastest of PACKED_KERNELS that ran there) where vnni_panel
    ran in all and the layout is more than LAYOUT_MARGIN less slow on average
    (kernel_choice.slowdown): its layout replaces the codes, so it cannot serve only some row
    counts."""
    row = {n: ts for n, ts in timings.items() if n not in PACKED_KERNELS}
    packed = timings.get(PACKED)
    complete = packed is not None and all(t is not None for t in packed)
    every = tuple(_packed_pick(timings, b) for b in range(len(defaults)))
    try:
        picks = kernel_choice.pick(row, defaults)
    except ValueError:  # no row-major timing in a bucket (a cache from before measure kept one)
        if complete:
            return every
        raise
    if not complete:
        return picks
    cost = kernel_choice.slowdown(every, timings)
    if cost < kernel_choice.slowdown(picks, timings) * (1 - kernel_choice.LAYOUT_MARGIN):
        return every
    return picks


def _packed_pick(timings: kernel_choice.Timings, b: int) -> str:
    """The fastest of PACKED_KERNELS in bucket b among those timed there (PACKED if none)."""
    ran: dict[str, float] = {}
    for name in PACKED_KERNELS:
        t = timings[name][b] if name in timings else None
        if t is not None:
            ran[name] = t
    return min(ran, key=ran.__getitem__, default=PACKED)


def shape_key(w: QTensor, x_dtype: torch.dtype) -> ShapeKey:
    dt = str(x_dtype).removeprefix("torch.")
    kind = f"{cpu_gemv.kind(w)}-g{w.group_size}" + ("-mins" if w.mins is not None else "")
    return ShapeKey(w.codes.shape[0], w.in_features, kind, dt, dt)


def machine_key() -> MachineKey:
    model, flags = cpu_build.cpu_info()
    kernels = cpu_kernels.build_id() or "none"
    # "keeps": measure keeps vnni_panel and the best row-major candidate in every bucket
    rules = f"quant:{kernel_choice.policy(CANDIDATES)};keeps"
    if cpu_kernels.quantized_activations() == "int8":  # integer decode timings differ
        rules += ":x8"
    return MachineKey.of(model, flags, torch.__version__, torch.get_num_threads(), kernels, rules)


def choose(
    weights: Sequence[QTensor], x_dtype: torch.dtype, tuning: str, packable: bool = False
) -> tuple[tuple[str, ...], str] | None:
    """(picks per bucket, where they came from) for these same-shaped weights; None where the
    C kernels cannot take them (the torch dequantizing path then runs). `packable`: whether
    the weights may be repacked for vnni_panel (picks of vnni_panel in every bucket mean the
    caller must: QuantWeight.pack_vnni). Weights only the panels take (8-bit codes in groups
    of 16, GGUF's Q6_K, Q3_K, Q2_K) choose among the panels' kernels alone."""
    probe = torch.empty(1, weights[0].in_features, dtype=x_dtype)
    row_major = cpu_gemv.usable(probe, weights[0])
    if not row_major and not (packable and cpu_vpanel.takes(weights[0], x_dtype)):
        return None
    if tuning not in kernel_choice.MODES:
        raise ValueError(f"cpu_kernel_tuning must be one of {kernel_choice.MODES}, not {tuning!r}")
    x8 = cpu_kernels.quantized_activations() == "int8"
    x8 = x8 and cpu_gemv.takes_int8_activations(weights[0])
    defaults = default_picks(cpu_gemv.kind(weights[0]), x_dtype, x8)
    names = offered(weights, packable, x_dtype)
    if not row_major:
        defaults = tuple(PACKED for _ in BUCKETS)
        names = tuple(n for n in names if n in PACKED_KERNELS)
    forced = os.environ.get("MINISGL_CPU_QUANT_LINEAR")
    if forced:
        return kernel_choice.forced(forced, names, defaults), "forced"
    if tuning == "off":
        return defaults, "defaults"
    shape, machine = shape_key(weights[0], x_dtype), machine_key()
    # what keys the cache keys the process's memo too: a change of activation mode or of
    # thread count within a process times again
    memo = (tuning, shape, machine, PACKED in names)
    if memo in _MEMO:
        return _MEMO[memo]
    cache = kernel_choice.TuningCache(cache_dir() / "tuning", machine)
    got = cache.get(shape, CANDIDATES) if tuning == "cached" else None
    if got is not None and PACKED in names and None in got.get(PACKED, [None]):
        got = None  # timed before as a weight that could not be packed: time again
    if got is not None:
        got = {name: t for name, t in got.items() if name in names}
    if got is not None:
        result = one_layout(got, defaults), "cached"
    else:
        spreads: list[float] = []
        others = kernel_choice.OtherWork()
        timings = measure(weights, x_dtype, spreads, defaults=defaults, names=names)
        if kernel_choice.disturbed(spreads):
            result = defaults, "defaults: timings disturbed, not cached"
        elif (
            others.share() > kernel_choice.OTHER_WORK_LIMIT
        ):  # a steady load: the best picks for now, not for later
            result = one_layout(timings, defaults), "measured beside other work"
        else:
            cache.put({shape: timings})
            result = one_layout(timings, defaults), "measured"
    _MEMO[memo] = result
    return result


def _timing_set(weights: Sequence[QTensor], rows: int) -> list[QTensor]:
    n, k = weights[0].shape
    flops = 2.0 * rows * n * k
    count = max(
        1, min(len(weights), -(-_COLD_BYTES // weights[0].nbytes()), int(_PASS_FLOPS // flops))
    )
    if flops <= _PASS_FLOPS:
        return list(weights[:count])
    # a multiple of 32 rows: whole panels for vnni_panel (cpu_vpanel.ROWS)
    keep = max(64, int(_PASS_FLOPS // (2.0 * rows * k)) // 32 * 32)
    return [weights[0].narrow(0, 0, min(n, keep))]


def _pass_tensors(group: Sequence[QTensor], name: str) -> list[torch.Tensor]:
    """The tensors candidate `name`'s pass over `group` reads (codes, scales, zero points; for
    vnni_panel those of the packed copies; group mins), flushed from the caches before each
    timed pass so it reads them from memory as a step does, whatever the last-level cache
    holds (as cpu_linear._cooler)."""
    packed = name in PACKED_KERNELS
    ws = [cpu_vpanel.held_copy(w) or w for w in group] if packed else list(group)
    mins = [t for w in group for t in (w.mins, w.mins_scales) if t is not None]
    return [t for w in ws for t in streamed(w)] + mins


def _timed_pass(
    name: str, group: Sequence[QTensor], x: torch.Tensor, clock: Callable[[], float]
) -> float:
    """Seconds of one pass of candidate `name` over the group, its tensors flushed first."""
    cpu_kernels.flush(_pass_tensors(group, name))
    t0 = clock()
    for w in group:
        _as_layer(name, x, w)
    return clock() - t0


def _as_layer(name: str, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """What a layer runs for a pick of `name`: a weight with group mins as cpu_panel.run_mins
    runs it (a packed pick on the packed copy, which keeps the mins as a packed layer does)."""
    if w.mins is None:
        return _RUN[name](x, w)
    if name in PACKED_KERNELS:
        return cpu_panel.run_mins(name, _PACKED_RUN[name], x, cpu_vpanel.packed_copy(w), None)
    return cpu_panel.run_mins(name, _RUN[name], x, w, None)


def measure(
    weights: Sequence[QTensor],
    x_dtype: torch.dtype,
    spreads: list[float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    defaults: Sequence[str] | None = None,
    names: Sequence[str] = CANDIDATES,
) -> dict[str, list[float | None]]:
    """Seconds per pass for each candidate and bucket (interleaved passes, the best counts;
    one more than DROP_BEHIND x behind the leader after DROP_AFTER passes (kernel_choice) is
    dropped: None, never vnni_panel).
    The leader, the candidates near it and the bucket's default (`defaults`, the untuned
    picks) get more passes in turn before the bests are final (kernel_choice.contenders). Only
    `names` run (the others: None)."""
    timings: dict[str, list[float | None]] = {name: [] for name in CANDIDATES}
    for b, rows in enumerate(TIMED_ROWS):
        group = _timing_set(weights, rows)
        x = torch.randn(rows, group[0].in_features).to(x_dtype)
        live = [name for name in CANDIDATES if name in names]
        if PACKED in live:  # its copies made before its passes, not in the first one
            cpu_vpanel.pack_copies(group)
        for name in live:
            _as_layer(name, x, group[0])  # warm-up
        best = {name: float("inf") for name in live}
        worst = {name: 0.0 for name in live}
        for rep in range(_MAX_REPEATS):
            improved = False
            for name in live:
                t = _timed_pass(name, group, x, clock)
                improved |= t < 0.98 * best[name]
                best[name], worst[name] = min(best[name], t), max(worst[name], t)
            if rep + 1 == kernel_choice.DROP_AFTER:
                lead = min(best.values())
                # vnni_panel stays, as cpu_linear's panels do: the packed layout's kernel for
                # every row count (one_layout needs it in each bucket), and one disturbed pass
                # in one bucket would take the layout from every bucket;
                # so does the best over the row-major codes, which must have a pick in every
                # bucket should the panels not be taken (fp8 panels at 8 rows: 3x ahead)
                rows_lead = min(
                    (n for n in live if n not in PACKED_KERNELS), key=best.__getitem__, default=""
                )
                behind = kernel_choice.DROP_BEHIND * lead
                live = [n for n in live if best[n] <= behind or n in (PACKED, rows_lead)]
            elif rep + 1 >= _MIN_REPEATS and not improved:
                break
        # The default in the confirming passes too: a burst of other work over its first
        # passes made a leader of a kernel 1.2x slower (an AVX2 EPYC VM's int4 prefill: qgemv
        # over dequant_panel at 65-512 rows, 0.89x bf16's prefill rate).
        again = kernel_choice.contenders(
            {n: best[n] for n in live}, defaults[b] if defaults is not None else None
        )
        for _ in range(kernel_choice.CONFIRM_REPEATS if len(again) > 1 else 0):
            for name in again:
                best[name] = min(best[name], _timed_pass(name, group, x, clock))
        for name in CANDIDATES:
            timings[name].append(best[name] if name in live else None)
        if spreads is not None:
            spreads += [worst[n] / best[n] for n in live if best[n] > 0]
    return timings


def kernels_for(
    groups: Sequence[Sequence[QTensor]], x_dtype: torch.dtype, tuning: str
) -> tuple[list[QuantKernel | None], str]:
    """A kernel per group of same-shaped weights, and one log line of the picks. Every group
    may be repacked (see choose): picks of vnni_panel in every bucket mean the caller must."""
    t0 = time.perf_counter()
    out: list[QuantKernel | None] = []
    chosen: dict[ShapeKey, tuple[str, ...]] = {}
    sources: set[str] = set()
    for weights in groups:
        got = choose(weights, x_dtype, tuning, packable=True)
        if got is None:
            out.append(None)
            continue
        picks, source = got
        out.append(QuantKernel(picks))
        chosen[shape_key(weights[0], x_dtype)] = picks
        sources.add(source)
    if not chosen:
        return out, ""
    how = "/".join(sorted(sources)) + f", {time.perf_counter() - t0:.1f} s"
    return out, kernel_choice.summary(chosen, how).replace("CPU matmul", "CPU quantized matmul")
