"""Python side of the CPU kernels (C sources in layers/csrc/, built by cpu_build.py).

- gemv: y[M, N] = x[M, K] @ W[N, K].T for small M. Decode streams every weight once per step,
  so its speed is memory bandwidth; on CPUs without AVX-512, torch's bf16 path (and oneDNN's,
  which refuses bf16 there) reads weights at a fraction of it. The kernel converts bf16 to fp32
  with a shift, accumulates in fp32 with FMAs, keeps four weight rows times two input rows in
  registers, and splits output rows across threads.
- gemv512 (AVX-512 build only): the same product on 16 lanes, with native bf16 dot products
  where the CPU has AVX512-BF16 (bf16 x): cheaper per row, so it stays bandwidth-bound at more
  rows.
- gemm: the same product for many rows (batched decode, prefill): W converted to fp32 a
  16-row panel at a time, then a 6x16 register-blocked micro-kernel. torch's bf16 matmul on
  AVX2 (no native bf16) runs ~7 GFLOP/s; this one runs at torch's fp32 speed (~75 per core)
  without an fp32 copy of the weights.
- panel: the same product for any M from bf16 weights repacked once into 16-column panels
  (csrc/panel.c): one contiguous stream per thread and a 6x16 register tile with no per-call
  conversion. Where it is measured fastest for every row count the panels replace the weight.
  The AVX-512 build packs 32-column panels with K in pairs instead (csrc/panel512.c): native
  bf16 dot products (bf16 x) where the CPU has AVX512-BF16, else 16-lane FMAs; register tiles
  of up to 12 rows x 32 columns, one layout for every row count (PanelWeight.pairs says which
  layout a copy is).
- moe_decode: a mixture's expert MLPs at decode (bf16 experts) in one call: the chosen
  experts' GEMV blocks shared among the threads in one parallel region (csrc/moe.c), not two
  GEMV calls and a SiLU per expert, each a fork and join with a cold start of its prefetch.
- decode attention: one query per request straight over the paged pool (slot indices, no
  gather copy), scores/softmax/weighted sum in fp32. torch's CPU SDPA spends ~0.5 ms per call
  on a single query, more than the layer's matmuls.
All use torch's own OpenMP threads (they link the libgomp torch already loaded). Which matmul
runs for which layer and row count is measured at start-up (cpu_linear.py, kernel_choice.py).

Anything missing (no compiler, no AVX2, MINISGL_CPU_KERNELS=0) means `load()` returns None and
callers keep their PyTorch path. Results match F.linear to fp32 rounding (the summation order
differs).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl import hugepages
from minisgl.layers import cpu_build

logger = logging.getLogger(__name__)

# Row counts up to which the GEMV is the default where no measurement decides (tuning "off"):
# beyond it the blocked GEMM (measured at 1024x6144 on AVX2, bf16 and fp32: GEMM ahead from
# ~20 rows).
MAX_ROWS = 16

# The dtypes the elementwise and attention kernels take.
_FLOATS = (torch.bfloat16, torch.float32)


def _isa() -> str | None:
    if os.environ.get("MINISGL_CPU_KERNELS", "1") in ("0", "false", "no"):
        return None
    _, flags = cpu_build.cpu_info()
    return cpu_build.pick_isa(flags, os.environ.get("MINISGL_CPU_ISA") or None)


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        args: list[Any] = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.gemv_f32.argtypes = args
        lib.gemv_bf16.argtypes = args + [ctypes.c_int]  # + whether x is bf16
        for fn in (lib.gemv_bf16, lib.gemv_f32):
            fn.restype = None
        self.bf16, self.f32 = lib.gemv_bf16, lib.gemv_f32
        attn_args: list[Any] = [ptr, i64, ctypes.c_int] + [ptr] * 4 + [i64, ptr, ctypes.c_int]
        attn_args += [i64, i64, i64, i64, ctypes.c_float, ptr, i64, ptr, i64, ptr]
        for fn in (lib.decode_attn_bf16, lib.decode_attn_f32, lib.decode_attn_e4m3):
            fn.argtypes = attn_args
            fn.restype = None
        self.attn_bf16, self.attn_f32 = lib.decode_attn_bf16, lib.decode_attn_f32
        self.attn_e4m3 = lib.decode_attn_e4m3
        # Its bf16 passes on 16 lanes (csrc/attention.c; 1 = on): q.k on VDPBF16PS, the
        # values' sums (the same bits as 8 lanes). Switches for tests and benchmarks.
        self.attn_dpbf16: Any = _global(lib, "attn_dpbf16", ctypes.c_int)
        self.attn_v512: Any = _global(lib, "attn_v512", ctypes.c_int)
        # e4m3 pools' passes on 16 lanes.
        self.attn_e4m3_512: Any = _global(lib, "attn_e4m3_512", ctypes.c_int)
        lib.gemm.argtypes = [ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int]
        lib.gemm.restype = None
        self.gemm = lib.gemm
        lib.panel_pack_bf16.argtypes = [ptr, ptr, i64, i64]
        lib.panel_bf16.argtypes = args + [ctypes.c_int]  # + whether x is bf16
        for fn in (lib.panel_pack_bf16, lib.panel_bf16):
            fn.restype = None
        self.panel_pack, self.panel = lib.panel_pack_bf16, lib.panel_bf16
        # The layout panel_pack_bf16 writes: 0 (panel.c) [K][16] with the lanes interleaved,
        # 1 (panel512.c, AVX-512) [K/2][32][2]: K in pairs, VDPBF16PS's layout.
        self.panel_layout = ctypes.c_int.in_dll(lib, "panel_layout").value
        # panel512.c's prefetch distance (bytes) and cache (1: L2), for the benchmarks.
        self.panel512_pf_ahead: Any = _global(lib, "panel512_pf_ahead", ctypes.c_int64)
        self.panel512_pf_l2: Any = _global(lib, "panel512_pf_l2", ctypes.c_int)
        # The same for the one-tile passes of 7 rows and more.
        self.panel512_pf_many_ahead: Any = _global(lib, "panel512_pf_many_ahead", ctypes.c_int64)
        self.panel512_pf_many_l2: Any = _global(lib, "panel512_pf_many_l2", ctypes.c_int)
        # 1: the chunked passes' prefetch of the next chunk spread over two tiles.
        self.panel512_spread: Any = _global(lib, "panel512_spread", ctypes.c_int)
        # panel.c's prefetch distance (bytes) for its passes of up to 16 rows.
        self.panel_pf_near: Any = _global(lib, "panel_pf_near", ctypes.c_int64)
        # 1: panel.c's passes of 17-64 rows convert each chunk to fp32 first, as more rows'
        # do; set by measure_panel_convert_first.
        self.panel_convert_first: Any = _global(lib, "panel_convert_first", ctypes.c_int)
        # 1: few rows prefetch as more rows do (far ahead: panel512.c's 8 KB into L2 from 7
        # rows, panel.c's two chunks into L1 from 17); set by measure_panel_few_rows_far.
        self.panel_few_rows_far: Any = _global(lib, "panel_few_rows_far", ctypes.c_int)
        norm_args: list[Any] = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ctypes.c_float]
        for fn in (lib.rmsnorm_bf16, lib.rmsnorm_f32):
            fn.argtypes = norm_args + [ptr, ptr]
            fn.restype = None
        self.norm_bf16, self.norm_f32 = lib.rmsnorm_bf16, lib.rmsnorm_f32
        for fn in (lib.silu_mul_bf16, lib.silu_mul_f32):
            fn.argtypes = [ptr, ptr, i64, i64]
            fn.restype = None
        self.silu_mul_bf16, self.silu_mul_f32 = lib.silu_mul_bf16, lib.silu_mul_f32
        lib.kv_store.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64]
        lib.kv_store.restype = i64
        self.kv_store = lib.kv_store
        lib.kv_store_e4m3.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64]
        lib.kv_store_e4m3.argtypes += [ctypes.c_int, ptr, ptr]
        lib.kv_store_e4m3.restype = i64
        self.kv_store_e4m3 = lib.kv_store_e4m3
        lib.rows_argmax.argtypes = [ptr, i64, i64, ptr, ptr]
        lib.rows_argmax.restype = None
        self.rows_argmax = lib.rows_argmax
        lib.rows_logprob.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr]
        lib.rows_logprob.restype = None
        self.rows_logprob = lib.rows_logprob
        lib.rows_nucleus_cutoff.argtypes = [ptr, i64, i64, ptr, ptr]
        lib.rows_nucleus_cutoff.restype = None
        self.rows_nucleus_cutoff = lib.rows_nucleus_cutoff
        # Matmul and dequantizer over quantized weights (qgemv.c; minisgl/quant/cpu_gemv.py),
        # by code kind.
        codes = ("u4", "u8", "fp8")
        self.qgemv = _quant_kernels(lib, "qgemv", codes, _QMM_ARGS)
        self.qdequant = _quant_kernels(lib, "qdequant", codes, _QROWS_ARGS)
        # A weight's group mins' term after one of them (qmins.c; minisgl/quant/matmul.py):
        # (x, x_bf16, fp32 product, the mins' MINS_ARGS, y, out_bf16, M, N, K, group size).
        lib.qmins.argtypes = [ptr, ctypes.c_int, ptr, *MINS_ARGS, ptr, ctypes.c_int,
                              i64, i64, i64, i64]  # fmt: skip
        lib.qmins.restype = ctypes.c_int  # 0: no memory for the sums of x
        self.qmins = lib.qmins
        # Many rows over quantized weights, a panel dequantized once for all of them
        # (qdequant.c; minisgl/quant/cpu_panel.py): qgemv's arguments.
        # qpanel16_*: integer codes against x quantized per row to int16.
        self.qpanel = _quant_kernels(lib, "qpanel", codes, _QMM_ARGS)
        self.qpanel16 = _quant_kernels(lib, "qpanel16", codes, _QMM_ARGS)
        # The same over AMX tiles, bf16 activations only (qamx.c): in a build that targets
        # AMX, once the kernel granted this process the tile state.
        self.qamx = _tile_kernels(lib, "qamx", ("u4", "u8", "fp8"))
        # Few rows straight from the codes on AMX tiles: integer codes on AMX-INT8 (qamxi.c),
        # fp8 codes converted to bf16 on AMX-BF16 (qamxf.c); where the build targets AMX and
        # the tiles were granted; qgemv's arguments.
        self.qamxi = _tile_kernels(lib, "qamxi", ("u4", "u8")) | _tile_kernels(
            lib, "qamxf", ("fp8",)
        )
        # A mixture's expert MLPs at decode as one call (moe.c).
        lib.moe_decode_bf16.argtypes = [ptr, ctypes.c_int, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
        lib.moe_decode_bf16.argtypes += [ptr] + [i64] * 4
        lib.moe_decode_bf16.restype = i64
        self.moe_decode = lib.moe_decode_bf16
        lib.moe_decode_q.argtypes = lib.moe_decode_bf16.argtypes
        lib.moe_decode_q.restype = i64
        self.moe_decode_q = lib.moe_decode_q
        lib.moe_decode_f.argtypes = lib.moe_decode_bf16.argtypes
        lib.moe_decode_f.restype = i64
        self.moe_decode_f = lib.moe_decode_f
        # The router's top-k choice (moe.c): logits, logits_bf16, T, E, k, renorm, weights,
        # weights_bf16, ids.
        lib.moe_route.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ctypes.c_int, ptr]
        lib.moe_route.argtypes += [ctypes.c_int, ptr]
        lib.moe_route.restype = None
        self.moe_route = lib.moe_route
        # A decode step's layers as one call (chain.c; layers/cpu_chain.py).
        self.decode_chain: Any = getattr(lib, "decode_chain", None)
        if self.decode_chain is not None:
            self.decode_chain.argtypes = [ptr, i64, ptr]
            self.decode_chain.restype = i64
        # The same with each op's time (benchmarks' breakdown): + ns per op, clock (0 wall).
        self.decode_chain_timed: Any = getattr(lib, "decode_chain_timed", None)
        if self.decode_chain_timed is not None:
            self.decode_chain_timed.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int]
            self.decode_chain_timed.restype = i64
        lib.stream_read.argtypes = [ptr, i64]
        lib.stream_read.restype = ctypes.c_float
        self.stream_read = lib.stream_read
        lib.flush_lines.argtypes = [ptr, i64]
        lib.flush_lines.restype = None
        self.flush_lines = lib.flush_lines
        lib.fma_peak.argtypes = [i64, ptr]
        lib.fma_peak.restype = i64
        self.fma_peak = lib.fma_peak
        # Where the elementwise kernels start splitting rows over the threads (common.h).
        self.norm_parallel_min = ctypes.c_int64.in_dll(lib, "norm_parallel_min")
        self.silu_parallel_min = ctypes.c_int64.in_dll(lib, "silu_parallel_min")
        # The AMX matmul (amx.c): in every build, 0 from amx_available where it cannot run
        # (no AMX in the build or the CPU, or the OS refused the tile state).
        lib.amx_available.argtypes = []
        lib.amx_available.restype = ctypes.c_int
        lib.amx_bf16.argtypes = args
        lib.amx_bf16.restype = ctypes.c_int
        self.amx: Any = lib.amx_bf16 if lib.amx_available() else None
        self.amx_prefetch_hint: Any = (
            ctypes.c_int.in_dll(lib, "amx_prefetch_hint") if self.amx is not None else None
        )
        # Whether its weight rows of a page or more are left to the hardware prefetcher: set
        # by measure_amx_rows_to_hardware.
        self.amx_rows_to_hardware: Any = (
            ctypes.c_int.in_dll(lib, "amx_rows_to_hardware") if self.amx is not None else None
        )
        # x in 8 bits against integer codes (qgemv.c, --cpu-quantized-activations): 0 or 1.
        self.qgemv_x8 = ctypes.c_int.in_dll(lib, "qgemv_x8")
        # The most input rows it takes (decode batches), and which codes (bits, K, group).
        self.qgemv_x8_rows = ctypes.c_int.in_dll(lib, "qgemv_x8_rows").value
        lib.qgemv_x8_takes.argtypes = [ctypes.c_int, i64, i64]
        lib.qgemv_x8_takes.restype = ctypes.c_int
        self.qgemv_x8_takes = lib.qgemv_x8_takes
        # Many rows of x in 8 bits against integer codes (qvnni.c, AVX512-VNNI builds only;
        # cpu_panel.x8_panel): qgemv's arguments, and which codes it takes (bits, K, group).
        self.qvnni = _quant_kernels(lib, "qvnni", ("u4", "u8"), _QMM_ARGS)
        # Integer codes repacked into 32-row panels, exact int16 x, any row count (qvpanel.c,
        # AVX512-VNNI builds only; quant/cpu_vpanel.py): qgemv's arguments, and which weights
        # it takes (bits, N, K, group).
        # Its rows dequantized (qdequant's arguments): a packed tied table's lookups.
        # fp8 codes too where the build has AVX512-VBMI (bf16 x only).
        self.qvpanel = _quant_kernels(lib, "qvpanel", ("u4", "u8", "fp8"), _QMM_ARGS)
        self.qvpanel_rows = _quant_kernels(lib, "qvpanel_rows", ("u4", "u8", "fp8"), _QROWS_ARGS)
        # The same panels of integer codes on AMX-INT8 tiles, the same bits (qvpanel.c's
        # va_matmul): where the build targets AMX and the tiles were granted.
        self.qvpanel_amx = _tile_kernels(lib, "qvpanel_amx", ("u4", "u8"))
        # The same panels dequantized to bf16 (qamx.c's panel kernel over the packed layout:
        # amx_panel's values, bf16 x only), AMX tiles or VDPBF16PS as qamx.
        packed = _tile_kernels(lib, "qamx", ("p4", "p8"))
        self.qamx_packed = {k: packed[p] for k, p in (("u4", "p4"), ("u8", "p8")) if p in packed}
        # Both with each group's min folded into the panel (weights whose groups carry mins:
        # GGUF's Q4_K, Q4_1, Q2_K ...), row-major and packed, where qamx runs.
        mins = _quant_kernels(lib, "qamx_mins", ("u4", "u8", "p4", "p8"), _QMM_MINS_ARGS)
        mins = mins if self.qamx else {}
        self.qamx_mins = {k: mins[k] for k in ("u4", "u8") if k in mins}
        self.qamx_mins_packed = {k: mins[p] for k, p in (("u4", "p4"), ("u8", "p8")) if p in mins}
        self.qvpanel_takes: Any = getattr(lib, "qvpanel_takes", None)
        # Whether its one-row form prefetches into L2 (cpu_vpanel measures it once).
        self.vp_row_prefetch = (
            ctypes.c_int.in_dll(lib, "vp_row_prefetch") if self.qvpanel_takes is not None else None
        )
        # From how many rows its exact form widens each chunk's codes once (cpu_vpanel
        # measures it once per process), per code width; 0: never.
        self.vp_wide_rows: dict[int, Any] = (
            {b: ctypes.c_int.in_dll(lib, f"vp_wide_rows{b}") for b in (8, 4)}
            if self.qvpanel_takes is not None
            else {}
        )
        if self.qvpanel_takes is not None:
            self.qvpanel_takes.argtypes = [ctypes.c_int, i64, i64, i64]
            self.qvpanel_takes.restype = ctypes.c_int
        self.qvnni_takes: Any = getattr(lib, "qvnni_takes", None)
        if self.qvnni_takes is not None:
            self.qvnni_takes.argtypes = [ctypes.c_int, i64, i64]
            self.qvnni_takes.restype = ctypes.c_int
        # The AVX-512 GEMV exists in that build only.
        self.gemv512_bf16: Any = getattr(lib, "gemv512_bf16", None)
        self.gemv512_f32: Any = getattr(lib, "gemv512_f32", None)
        for wide in (self.gemv512_bf16, self.gemv512_f32):
            if wide is not None:
                wide.argtypes = args
                wide.restype = None
        # Its prefetch into L1 instead of L2 (benchmarks compare the two): 0 or 1.
        self.gemv512_prefetch_l1: Any = _global(lib, "gemv512_prefetch_l1", ctypes.c_int)
        # Whether it reads a block's rows in turn (1) or together (0) for up to 8 rows of x:
        # set by measure_gemv512_rows_in_turn.
        self.gemv512_rows_in_turn: Any = _global(lib, "gemv512_rows_in_turn", ctypes.c_int)


def _global(lib: Any, name: str, ctype: Any) -> Any:
    """The library's global `name` as a ctypes value, or None where the build has none."""
    try:
        return ctype.in_dll(lib, name)
    except ValueError:
        return None


_LIB: _Lib | None = None
_LIB_PATH: Path | None = None
_TRIED = False


def load() -> _Lib | None:
    """The compiled kernel, or None where it cannot be used here."""
    global _LIB, _LIB_PATH, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            isa, flags = _isa(), cpu_build.cpu_info()[1]
            path = cpu_build.build(isa, flags) if isa is not None else None
            if path is None and isa == "avx512":  # e.g. a compiler too old for AVX512-BF16
                logger.warning("CPU kernels: the AVX-512 build failed, the AVX2 build runs")
                isa, path = "avx2", cpu_build.build("avx2", flags)
            _LIB = _Lib(path) if path is not None else None
            _LIB_PATH = path
            if _LIB is not None and isa is not None:
                extras = cpu_build.extensions(isa, flags)
                suffix = f" (with {' '.join(extras)})" if extras else ""
                logger.info("CPU kernels: the %s build%s", isa, suffix)
                _set_split_points(_LIB)
        except OSError as e:
            logger.info("CPU kernels unavailable: %s", e)
            _LIB = None
    return _LIB


def _loaded() -> _Lib | None:
    """load()'s answer, one global read once it has been tried: the per-call wrappers below
    run ~200 times in a decode step, each on caches the weight stream evicted."""
    return _LIB if _TRIED else load()


# Never split (one thread), as a value the C side compares against.
_NEVER = 2**63 - 1
# A split must save at least this many times the fork and join it costs: that cost varies
# from call to call (a thread late to wake), the arithmetic it saves does not.
_SPLIT_PAYBACK = 2.0
_SPLIT_POINTS: dict[str, int] = {}


def split_point(fork_s: float, serial_s_per_value: float, threads: int) -> int:
    """Values from which splitting an elementwise kernel's rows over `threads` threads pays:
    split, it takes fork_s + W * rate / threads instead of W * rate, and the saving
    W * rate * (1 - 1 / threads) must be _SPLIT_PAYBACK times the fork's cost."""
    if threads <= 1 or serial_s_per_value <= 0:
        return _NEVER
    saved_per_value = serial_s_per_value * (1 - 1 / threads)
    return min(_NEVER, max(1, math.ceil(_SPLIT_PAYBACK * fork_s / saved_per_value)))


def _set_split_points(lib: _Lib) -> None:
    """Measure, on the running machine, what waking the threads for one kernel call costs and
    how fast each elementwise kernel runs on one thread; set where each starts to split."""
    threads = torch.get_num_threads()
    d = 1024
    x, res = torch.randn(64, d).bfloat16(), torch.randn(64, d).bfloat16()
    w = torch.ones(d).bfloat16()
    gate_up = torch.randn(64, 2 * d).bfloat16()

    def norm(rows: int) -> None:
        rms_norm(x[:rows], w, 1e-6, res[:rows])

    def times(fn: Callable[[], object], reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    lib.norm_parallel_min.value = lib.silu_parallel_min.value = _NEVER
    norm(1)  # first-call set-up
    serial_norm = min(times(lambda: norm(64), 9)) / (64 * d)
    serial_silu = min(times(lambda: silu_mul(gate_up), 9)) / (64 * d)
    # The fork: one row split (the other threads get none) against one row on one thread,
    # taken in turns, right after the threads last ran (as in a step); the median, as a step
    # sees it.
    # A busy machine wakes threads slowly: at most ~0.25 s of this at start.
    split: list[float] = []
    alone: list[float] = []
    end = time.perf_counter() + 0.25
    while len(split) < 31 and (len(split) < 5 or time.perf_counter() < end):
        lib.norm_parallel_min.value = 0
        split += times(lambda: norm(1), 1)
        lib.norm_parallel_min.value = _NEVER
        alone += times(lambda: norm(1), 1)
    fork = max(1e-7, statistics.median(split) - statistics.median(alone))
    lib.norm_parallel_min.value = split_point(fork, serial_norm, threads)
    lib.silu_parallel_min.value = split_point(fork, serial_silu, threads)
    _SPLIT_POINTS.update(norm=lib.norm_parallel_min.value, silu=lib.silu_parallel_min.value)
    logger.info(
        "CPU elementwise kernels: waking %d threads costs %.1f us; rows split from %s values "
        "(RMSNorm), %s (SiLU)",
        threads,
        fork * 1e6,
        _SPLIT_POINTS["norm"] if _SPLIT_POINTS["norm"] < _NEVER else "never",
        _SPLIT_POINTS["silu"] if _SPLIT_POINTS["silu"] < _NEVER else "never",
    )


def split_points() -> dict[str, int]:
    """{"norm": values, "silu": values} from which those kernels split their rows (as set at
    load; 2**63 - 1: never)."""
    load()
    return dict(_SPLIT_POINTS)


def build_id() -> str | None:
    """The loaded build, as "<isa>-<source digest>" (part of the tuning cache's key)."""
    if load() is None or _LIB_PATH is None:
        return None
    return _LIB_PATH.stem.removeprefix("cpu-kernels-")


def set_quantized_activations(mode: str) -> None:
    """--cpu-quantized-activations: "int8" multiplies integer codes by x rounded to 8 bits per
    block of at most 128 features (qgemv.c's qgemv_x8 in decode batches of up to
    x8_gemv_rows() rows, and with AVX512-VNNI qvnni.c for more rows: prefill too, and
    qvpanel.c's packed panels for every row count; the codes cpu_gemv.takes_int8_activations
    says: 8- and 4-bit with AVX512-VNNI, 4-bit without), "int16" by x in 15 bits (exact)."""
    if mode not in ("int16", "int8"):
        raise ValueError(f"cpu_quantized_activations must be int16 or int8, not {mode!r}")
    lib = load()
    if lib is not None:
        lib.qgemv_x8.value = int(mode == "int8")


# int8_activation_rows() where qvnni.c takes the rows past the GEMV's: every row count.
ALL_ROWS = 1 << 62


def int8_activation_rows() -> int:
    """The most input rows --cpu-quantized-activations int8 applies to here (0: none;
    ALL_ROWS: every row count, prefill too, where the build has qvnni.c's many-row kernel,
    AVX512-VNNI). x8_gemv_rows() of them in the decode GEMV (qgemv.c), the rest in qvnni.c."""
    lib = load()
    if lib is None or not lib.qgemv_x8_rows:
        return 0
    return ALL_ROWS if lib.qvnni else lib.qgemv_x8_rows


def x8_gemv_rows() -> int:
    """The most input rows the decode GEMV (qgemv.c's qgemv_x8) rounds x for (0: none)."""
    lib = load()
    return lib.qgemv_x8_rows if lib is not None else 0


def quantized_activations() -> str:
    """The mode set_quantized_activations set ("int16" without kernels)."""
    lib = load()
    return "int8" if lib is not None and lib.qgemv_x8.value else "int16"


# The old names (--cpu-int4-activations), kept for callers of this module.
set_int4_activations = set_quantized_activations
int4_activations = quantized_activations


def isa() -> str | None:
    """The build in use ("avx2" or "avx512"), None without kernels."""
    built = build_id()
    return built.split("-")[0] if built else None


def supports(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.dim() == 2
        and weight.shape[1] % (16 if weight.dtype == torch.bfloat16 else 8) == 0
        and weight.is_contiguous()
        and load() is not None
    )


def _matmul_operands(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.dtype]:
    """The loaded library, x as contiguous fp32, and the output buffer [M, N]."""
    lib = load()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    xf = x.contiguous().float()
    return lib, xf, torch.empty(xf.shape[0], weight.shape[0], dtype=out_dtype), out_dtype


def gemv(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight.T -> [M, N] in `out_dtype` (default x's dtype)."""
    lib = load()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    out_bf16 = int(out_dtype == torch.bfloat16)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if weight.dtype == torch.bfloat16:
        # bf16 x goes in as it is (the kernel converts it in its even/odd split): no fp32 copy
        # of x per call, 113 calls a decode step.
        x_bf16 = x.dtype == torch.bfloat16
        xc = x.contiguous() if x_bf16 else x.contiguous().float()
        lib.bf16(xc.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, out_bf16, int(x_bf16))
    else:
        xf = x.contiguous().float()
        lib.f32(xf.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, out_bf16)
    return y


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route's choice for router logits [T, E] (bf16 or fp32, on the CPU; see
    `moe_route_supported`): softmax in fp32, the top_k in descending order (ties to the lower
    id), optionally renormalised -> (weights [T, top_k] in out_dtype, bf16 or fp32, ids int64).
    One C call, where torch's is ~8 ops a layer; the decode chain's route is this call."""
    lib = _loaded()
    assert lib is not None
    t, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=out_dtype)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    args = (logits.data_ptr(), int(logits.dtype == torch.bfloat16), t, e, top_k, int(renormalize))
    lib.moe_route(*args, weights.data_ptr(), int(out_dtype == torch.bfloat16), ids.data_ptr())
    return weights, ids


def moe_route_supported(logits: torch.Tensor, top_k: int) -> bool:
    """moe_route takes 2-D bf16 or fp32 logits on the CPU and a top_k of at most E."""
    return (
        logits.is_cpu
        and logits.dim() == 2
        and logits.dtype in _FLOATS
        and 0 < top_k <= logits.shape[1]
        and _loaded() is not None
    )


def supports_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """moe_decode takes x [T, H] (bf16 or fp32) against bf16 experts w13 [E, 2I, H] and w2
    [E, H, I], all contiguous on the CPU, with H and I multiples of 16."""
    if not (x.is_cpu and x.dim() == 2 and x.dtype in _FLOATS and w13.dim() == w2.dim() == 3):
        return False
    e, i2, h = w13.shape
    return (
        all(w.is_cpu and w.dtype == torch.bfloat16 and w.is_contiguous() for w in (w13, w2))
        and tuple(w2.shape) == (e, h, i2 // 2)
        and i2 % 2 == 0
        and x.shape[1] == h
        and h % 16 == 0
        and (i2 // 2) % 16 == 0
        and _loaded() is not None
    )


def moe_decode(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] in x's dtype, the experts' SwiGLU
    MLPs (see supports_moe_decode) in one call: each expert's rows are the GEMV's (`gemv`) on
    the tokens that chose it, so the result is the same bits as that per-expert loop's with
    silu_mul between and the weighting summed in fp32 in slot order (moe.fused_moe)."""
    lib = _loaded()
    assert lib is not None
    e, i2, _ = w13.shape
    return _moe_call(lib.moe_decode, x, w13.data_ptr(), w2.data_ptr(), e, i2 // 2, weights, ids)


def moe_decode_q(
    x: torch.Tensor,
    q13: torch.Tensor,
    q2: torch.Tensor,
    num_experts: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """moe_decode over quantized experts: q13 and q2 are each one's operands and kernel per
    row count as csrc/moe.c's int64 words (moe.py builds them), each expert's rows through the
    kernel the per-expert loop calls for them (the same bits); the experts, not their weight
    blocks, are shared among the threads."""
    lib = _loaded()
    assert lib is not None
    inter = int(q2[9])  # w2's K
    return _moe_call(
        lib.moe_decode_q, x, q13.data_ptr(), q2.data_ptr(), num_experts, inter, weights, ids
    )


def moe_decode_f(
    x: torch.Tensor,
    f13: torch.Tensor,
    f2: torch.Tensor,
    num_experts: int,
    inter: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """moe_decode over float experts whose GEMV picks are not `gemv` at every row count (gemv512
    on AVX-512): f13 and f2 are each one's weights and per-row-count kernels as csrc/moe.c's
    words (moe.py builds them); each expert's rows through the kernel the per-expert loop
    picks for them (the same bits), whole experts shared among the threads."""
    lib = _loaded()
    assert lib is not None
    args = (f13.data_ptr(), f2.data_ptr(), num_experts, inter, weights, ids)
    return _moe_call(lib.moe_decode_f, x, *args)


def _moe_call(
    fn: Any,
    x: torch.Tensor,
    w13: int,
    w2: int,
    num_experts: int,
    inter: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """csrc/moe.c's `fn` over the experts at w13 / w2 (their data, or their operand words):
    the routing as it takes it (int64 ids, fp32 or bf16 weights, per (token, slot) pair) and
    an out-of-range expert id as an IndexError."""
    t, k = ids.shape
    x = x.contiguous()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    w_bf16 = weights.dtype == torch.bfloat16
    w = weights.reshape(-1).contiguous() if w_bf16 else weights.reshape(-1).float().contiguous()
    out = torch.empty_like(x)
    x_bf16 = int(x.dtype == torch.bfloat16)
    args = (x.data_ptr(), x_bf16, w13, w2, num_experts, flat.data_ptr(), w.data_ptr())
    bad = fn(*args, int(w_bf16), out.data_ptr(), t, k, x.shape[1], inter)
    if bad >= 0:
        raise IndexError(f"expert id {int(flat[bad])} outside the {num_experts} experts")
    if bad == -2:
        raise RuntimeError("an expert's matmul computed nothing (no memory for its packed x)")
    return out


def flush(tensors: Iterable[torch.Tensor]) -> bool:
    """Every cache line of these CPU tensors (strided ones; others are skipped) out of the
    caches (csrc/stream.c's flush_lines), so the next read of them comes from memory, as a
    decode step's read of its weights does whatever the size of the last-level cache. False
    (nothing done) without the kernels."""
    lib = load()
    if lib is None:
        return False
    for t in tensors:
        if t.layout == torch.strided and t.device.type == "cpu" and t.numel():
            lib.flush_lines(t.data_ptr(), t.numel() * t.element_size())
    return True


def supports_gemv512(x_dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """The AVX-512 GEMV takes bf16 x with bf16 weights (K % 32), fp32 with fp32 (K % 16)."""
    lib = load()
    if lib is None or lib.gemv512_bf16 is None or not supports(weight):
        return False
    if weight.dtype == torch.bfloat16:
        return x_dtype == torch.bfloat16 and weight.shape[1] % 32 == 0
    return x_dtype == torch.float32 and weight.shape[1] % 16 == 0


def time_switch(
    switch: Any, run: Callable[[], object], cold: list[torch.Tensor], passes: int
) -> dict[int, float]:
    """The best seconds of run() with a C kernel's switch (a ctypes int) at 0 and at 1, in turns
    `passes` times, `cold` flushed from the caches before each run (weights read from memory,
    as in a decode step); the switch is left at 1 where that was 3% faster, else at 0."""
    best = {0: math.inf, 1: math.inf}
    for _ in range(passes):
        for on in best:
            switch.value = on
            flush(cold)
            t0 = time.perf_counter()
            run()
            best[on] = min(best[on], time.perf_counter() - t0)
    switch.value = int(best[1] < 0.97 * best[0])
    return best


def _read_rates(
    switch: Any,
    kernel: Callable[..., torch.Tensor],
    shape: tuple[int, int],
    rows: int,
    passes: int,
) -> tuple[float, float]:
    """GB/s of kernel(x, w) for `rows` rows of x against a cold bf16 weight of `shape` on huge
    pages, with the switch at 0 and at 1 (time_switch: left at the faster)."""
    # Written, so that every page is its own (a mapping never written reads one shared zero
    # page); the kernels' speed does not depend on the values.
    w = hugepages.empty(*shape, dtype=torch.bfloat16).fill_(0.5)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    best = time_switch(switch, lambda: kernel(x, w), [w], passes)
    nbytes = w.numel() * w.element_size()
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


_ROWS_IN_TURN_MEASURED = False
_ROWS_IN_TURN_SHAPE = (32768, 1024)  # 64 MB of bf16, flushed from the caches each pass


def measure_gemv512_rows_in_turn() -> None:
    """Whether gemv512 (up to 8 rows of x) reads each 8-row block's rows in turn (one
    sequential stream) or together (8 short streams), measured once per process on the running
    machine (gemv_avx512.c: in turn was 1.02-1.2x faster on a Xeon with AMX). One row against
    64 MB of bf16 weights on huge pages flushed from the caches, both ways in turns, the best
    of 7 each; in turn where it is 3% faster. The bits do not change, only the speed."""
    global _ROWS_IN_TURN_MEASURED
    lib = load()
    if _ROWS_IN_TURN_MEASURED or lib is None or lib.gemv512_rows_in_turn is None:
        return
    _ROWS_IN_TURN_MEASURED = True
    off, on = _read_rates(lib.gemv512_rows_in_turn, gemv512, _ROWS_IN_TURN_SHAPE, 1, 7)
    logger.info(
        "gemv512, one row: %s (%.1f GB/s in turn, %.1f together)",
        "rows in turn" if lib.gemv512_rows_in_turn.value else "rows together",
        on,
        off,
    )


_PANEL_FEW_MEASURED = False
_PANEL_FEW_SHAPE = (32768, 1024)  # 64 MB of panels, flushed from the caches each pass


def measure_panel_few_rows_far() -> None:
    """Whether the panels' passes of few rows prefetch as more rows' do, far ahead, instead of
    near (panel512.c below 7 rows: 8 KB ahead into L2 against 2 KB into L1, the first 1.06-1.13x
    faster at 1-4 rows on a Xeon without AVX512-BF16, the second 1.04-1.4x at 1-2 on a Zen 4;
    panel.c up to 16 rows: two 8 KB chunks ahead against 2 KB, both into L1, the second
    1.03-1.10x faster at 1-8 rows on a Zen 3), measured once per process on the running
    machine: 1 row and 4 rows of x against 64 MB of panels on huge pages flushed from the
    caches, both ways in turns, the best of 5 each; far where the two rows' times together are
    3% shorter. The bits do not change, only the speed."""
    global _PANEL_FEW_MEASURED
    lib = load()
    if _PANEL_FEW_MEASURED or lib is None or lib.panel_few_rows_far is None:
        return
    _PANEL_FEW_MEASURED = True
    n, k = _PANEL_FEW_SHAPE
    best = _panel_switch_times(lib.panel_few_rows_far, n, k, (1, 4))
    nbytes = 2 * 2 * n * k  # two passes over the bf16 weight
    logger.info(
        "panel, few rows: prefetch %s (%.1f GB/s far ahead, %.1f near)",
        "far" if lib.panel_few_rows_far.value else "near",
        nbytes / best[1] / 1e9,
        nbytes / best[0] / 1e9,
    )


def _panel_switch_times(switch: Any, n: int, k: int, rows: tuple[int, ...]) -> list[float]:
    """The seconds of panel() with `switch` at 0 and at 1, summed over `rows` rows of x against
    a cold n x k bf16 weight's panels (time_switch's best of 5 each, in turns); the switch
    left at 1 where that sum is 3% shorter, else at 0."""
    packed = panel_pack(torch.full((n, k), 0.5, dtype=torch.bfloat16))
    best = [0.0, 0.0]
    for r in rows:
        x = torch.randn(r, k, dtype=torch.bfloat16)

        def run(x: torch.Tensor = x) -> torch.Tensor:
            return panel(x, packed)

        times = time_switch(switch, run, [packed.data], 5)
        best = [best[0] + times[0], best[1] + times[1]]
    switch.value = int(best[1] < 0.97 * best[0])
    return best


_PANEL_CONVERT_MEASURED = False
_PANEL_CONVERT_SHAPE = (8192, 1024)  # 16 MB of panels, flushed from the caches each pass
_PANEL_CONVERT_ROWS = 32


def measure_panel_convert_first() -> None:
    """Whether panel.c's passes of 17-64 rows (a decode batch) convert each 8 KB chunk of a
    panel to fp32 once for all their row tiles, as more rows' do, or let each tile convert as
    it goes, as fewer rows' do (converting first was 1.25x faster at 64 rows on a Zen 3,
    converting in the tiles 1.06-1.12x faster at 32 rows on a later one), measured once per
    process on the running machine: 32 rows of x against 16 MB of panels on huge pages flushed
    from the caches, both ways in turns, the best of 5 each; first where that is 3% faster.
    The bits do not change, only the speed."""
    global _PANEL_CONVERT_MEASURED
    lib = load()
    if _PANEL_CONVERT_MEASURED or lib is None or lib.panel_convert_first is None:
        return
    _PANEL_CONVERT_MEASURED = True
    n, k = _PANEL_CONVERT_SHAPE
    best = _panel_switch_times(lib.panel_convert_first, n, k, (_PANEL_CONVERT_ROWS,))
    flops = 2 * _PANEL_CONVERT_ROWS * n * k
    logger.info(
        "panel, %d rows: %s (%.0f GFLOP/s converting each chunk first, %.0f in the tiles)",
        _PANEL_CONVERT_ROWS,
        "chunks converted first" if lib.panel_convert_first.value else "tiles convert",
        flops / best[1] / 1e9,
        flops / best[0] / 1e9,
    )


_AMX_ROWS_MEASURED = False
_AMX_ROWS_SHAPE = (8192, 4096)  # 64 MB of bf16 in rows of 8 KB, flushed each pass


def measure_amx_rows_to_hardware() -> None:
    """Whether amx leaves weight rows of a page (4 KB) or more to the hardware prefetcher, each
    k step's lines sent to L1 a step ahead, instead of prefetching the next block in memory
    order (amx.c: 1.05-1.6x faster at 8 and 32 rows on a Xeon with AMX), measured once per
    process on the running machine: 8 rows of x against 64 MB of bf16 weights on huge pages
    flushed from the caches, both ways in turns, the best of 5 each; on where it is 3% faster.
    The bits do not change, only the speed."""
    global _AMX_ROWS_MEASURED
    lib = load()
    if _AMX_ROWS_MEASURED or lib is None or lib.amx_rows_to_hardware is None:
        return
    _AMX_ROWS_MEASURED = True
    off, on = _read_rates(lib.amx_rows_to_hardware, amx, _AMX_ROWS_SHAPE, 8, 5)
    logger.info(
        "amx, rows of 4 KB or more: %s (%.1f GB/s left to the hardware prefetcher, %.1f with "
        "the next block prefetched)",
        "left to the hardware" if lib.amx_rows_to_hardware.value else "next block prefetched",
        on,
        off,
    )


def gemv512(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """As `gemv`, on the AVX-512 build; x in the weight's dtype (see supports_gemv512)."""
    lib = load()
    assert lib is not None and lib.gemv512_bf16 is not None
    fn = lib.gemv512_bf16 if weight.dtype == torch.bfloat16 else lib.gemv512_f32
    return _row_major_call(fn, x, weight, out_dtype)[0]


def _row_major_call(
    fn: Callable[..., Any], x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, Any]:
    """fn(x, W, y, M, N, K, out_bf16) for x [M, K] and a row-major W [N, K] -> (y [M, N] in
    `out_dtype`, default x's dtype; what fn returned)."""
    xc = x.contiguous()
    m, k = xc.shape
    n = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n, dtype=out_dtype)
    got = fn(
        xc.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, int(out_dtype == torch.bfloat16)
    )
    return y, got


def supports_amx(x_dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """The AMX matmul (csrc/amx.c) takes bf16 x with a bf16 weight whose K is a multiple of 32,
    where the CPU has AMX and the OS grants its tile state (MINISGL_CPU_AMX=0: never, to
    compare)."""
    lib = load()
    return (
        lib is not None
        and lib.amx is not None
        and os.environ.get("MINISGL_CPU_AMX", "1") not in ("0", "false", "no")
        and x_dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and supports(weight)
        and weight.shape[1] % 32 == 0
    )


def amx(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype) on AMX tiles, any M,
    straight from the row-major weight (see supports_amx)."""
    lib = load()
    assert lib is not None and lib.amx is not None
    y, done = _row_major_call(lib.amx, x, weight, out_dtype)
    if not done:
        raise RuntimeError(f"AMX matmul refused x {tuple(x.shape)} @ W {tuple(weight.shape)}.T")
    return y


@dataclass(frozen=True)
class PanelWeight:
    """A bf16 weight [n, k] repacked for `panel`: `data` [ceil(n / width), k, width], in the
    layout of the build (`pairs`): 16-column panels [k][16] with the lanes interleaved
    (panel.c), or on AVX-512 32-column panels whose k runs in pairs, [k / 2][32][2]
    (panel512.c; `data` views them as [k][32])."""

    data: torch.Tensor
    n: int
    pairs: bool = False


def supports_panel(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and supports(weight)


def panel_pairs() -> bool:
    """Whether the loaded build's panels are panel512.c's (K in pairs, 32 columns)."""
    lib = load()
    return lib is not None and lib.panel_layout == 1


def panel_pack(weight: torch.Tensor) -> PanelWeight:
    lib = load()
    assert lib is not None and supports_panel(weight)
    n, k = weight.shape
    pairs = lib.panel_layout == 1
    width = 32 if pairs else 16
    # On huge pages: a decode step streams every panel once (hugepages.py).
    data = hugepages.empty(-(-n // width), k, width, dtype=torch.bfloat16)
    lib.panel_pack(weight.data_ptr(), data.data_ptr(), n, k)
    return PanelWeight(data, n, pairs)


def panel_rows(packed: PanelWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight the panels hold -> [*ids.shape, k]: an embedding
    lookup straight from a tied LM head's panels."""
    flat = ids.reshape(-1)
    panels, k, width = packed.data.shape
    col = flat % width
    if packed.pairs:  # [k / 2][32][2]: column c's pairs, in order
        quads = packed.data.view(panels, k // 2, width, 2)
        return quads[flat // width, :, col, :].reshape(*ids.shape, k)
    lane = torch.where(col < 8, 2 * col, 2 * col - 15)  # the lane order of panel_pack_bf16
    return packed.data[flat // width, :, lane].reshape(*ids.shape, k)


def panel(
    x: torch.Tensor, packed: PanelWeight, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T from W's panels -> [M, N] in `out_dtype` (default x's dtype), any M."""
    lib = load()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    x_bf16 = x.dtype == torch.bfloat16
    xc = x.contiguous() if x_bf16 else x.contiguous().float()
    m, k = xc.shape
    y = torch.empty(m, packed.n, dtype=out_dtype)
    out_bf16 = int(out_dtype == torch.bfloat16)
    lib.panel(
        xc.data_ptr(), packed.data.data_ptr(), y.data_ptr(), m, packed.n, k, out_bf16, int(x_bf16)
    )
    return y


def rows_supported(x: torch.Tensor) -> bool:
    """Row reductions take contiguous fp32 [R, V] on the CPU."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.is_contiguous()
        and load() is not None
    )


def rows_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first index of it) of each row of x [R, V], as torch.max(x, dim=-1); a row with
    a NaN gets a NaN max."""
    lib = load()
    assert lib is not None
    r, v = x.shape
    top = torch.empty(r, dtype=torch.float32)
    best = torch.empty(r, dtype=torch.int64)
    lib.rows_argmax(x.data_ptr(), r, v, top.data_ptr(), best.data_ptr())
    return top, best


def rows_logprob(
    x: torch.Tensor, rows: list[int] | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp [R], top-k values [R, k], their ids [R, k]) of rows `rows` of x [*, V] (all
    when None), read in place; the top-k sorted descending, the lower id first among equals."""
    lib = load()
    assert lib is not None
    v = x.shape[1]
    idx = torch.tensor(rows, dtype=torch.int64) if rows is not None else None
    r = len(rows) if rows is not None else x.shape[0]
    k = min(k, v)
    lse = torch.empty(r, dtype=torch.float32)
    values = torch.empty(r, max(k, 1), dtype=torch.float32)
    ids = torch.empty(r, max(k, 1), dtype=torch.int64)
    lib.rows_logprob(
        x.data_ptr(),
        idx.data_ptr() if idx is not None else None,
        r,
        v,
        k,
        lse.data_ptr(),
        values.data_ptr(),
        ids.data_ptr(),
    )
    return lse, values[:, :k], ids[:, :k]


def nucleus_cutoff(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, V] (non-negative, contiguous fp32): the smallest probability of the
    top-p nucleus (its k best for the least k whose mass reaches top_p[r]; 0 where top_p[r] >=
    1), so the nucleus is `probs >= cutoff`."""
    lib = load()
    assert lib is not None
    r, v = probs.shape
    tp = top_p.to(torch.float32).contiguous()
    out = torch.empty(r, dtype=torch.float32)
    lib.rows_nucleus_cutoff(probs.data_ptr(), r, v, tp.data_ptr(), out.data_ptr())
    return out


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float | None:
    """Bytes per second this machine's threads read from memory (best of `repeats` passes over
    a buffer of `nbytes`), or None without kernels."""
    lib = load()
    if lib is None:
        return None
    buf = torch.ones(nbytes // 4 // 32 * 32)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass also faults the pages in
        t0 = time.perf_counter()
        lib.stream_read(buf.data_ptr(), buf.numel())
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def fma_flops(iters: int = 10_000_000, repeats: int = 6) -> float | None:
    """fp32 FLOP/s this machine's threads issue as fused multiply-adds at the kernels' vector
    width (best of `repeats` short passes: a pass that another task shared a core with reads
    as one thread's rate): the compute ceiling of every matmul and attention kernel here that
    multiplies in fp32. None without kernels."""
    lib = load()
    if lib is None:
        return None
    sink = ctypes.c_float()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        flops = lib.fma_peak(iters, ctypes.byref(sink))
        best = max(best, flops / (time.perf_counter() - t0))
    return best


def gemm(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype), any M; weight as for
    `supports` (K % 16 for bf16, K % 8 for fp32). Computed in fp32 from bf16 or fp32 weights."""
    lib, xf, y, out_dtype = _matmul_operands(x, weight, out_dtype)
    m, k = xf.shape
    n = weight.shape[0]
    lib.gemm(
        xf.data_ptr(),
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        y.data_ptr(),
        m,
        n,
        k,
        int(out_dtype == torch.bfloat16),
    )
    return y


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per request: q [B, Hq, D] (bf16 or fp32, any token stride) over the pool rows
    `slots` [B, kmax] (int64, the first lens[b] valid) of k/v_pool [S, Hkv, D] -> [B, Hq * D]
    in q's dtype. The kernel reads q where it lies (a view of the q/k tensor) and writes the
    output in that dtype: no torch copies or conversions around the call. `new`: (k, v, slots)
    of this step's tokens, k and v [B, Hkv, D] (see `can_write_new`), stored into the pools at
    slots [B] (int64) before the attention reads them."""
    lib = _loaded()
    assert lib is not None
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    if q.dtype not in _FLOATS:
        q = q.float()
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    q_bf16 = q.dtype == torch.bfloat16
    out = torch.empty(b, hq * d, dtype=q.dtype)
    fn = attention_kernel(lib, k_pool.dtype)
    k_new, v_new, new_slots = new if new is not None else (None, None, None)
    size = k_new.element_size() if k_new is not None else 0
    assert k_new is None or k_pool.dtype != _FP8 or k_new.dtype == q.dtype  # rounded as q's
    fn(
        q.data_ptr(),
        q.stride(0),
        q_bf16,
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        slots.shape[1],
        out.data_ptr(),
        q_bf16,
        b,
        hq,
        hkv,
        d,
        scale,
        k_new.data_ptr() if k_new is not None else None,
        k_new.stride(0) * size if k_new is not None else 0,
        v_new.data_ptr() if v_new is not None else None,
        v_new.stride(0) * size if v_new is not None else 0,
        new_slots.data_ptr() if new_slots is not None else None,
    )
    return out


# The pools decode_attention reads: the model's float dtypes, and fp8 e4m3 (--kv-cache-dtype).
_FP8 = torch.float8_e4m3fn
_POOL_DTYPES = (torch.bfloat16, torch.float32, _FP8)


def attention_kernel(lib: Any, pool_dtype: torch.dtype) -> Any:
    """The decode attention function of `lib` (_Lib) for pools of this dtype."""
    if pool_dtype == _FP8:
        return lib.attn_e4m3
    return lib.attn_bf16 if pool_dtype == torch.bfloat16 else lib.attn_f32


def can_write_new(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether decode_attention can store these new rows ([B, Hkv, D], any token stride) into
    `pool`'s layout itself: the pool's dtype (an fp8 pool: bf16 or fp32 rows, rounded as they
    are stored, the query's dtype), each token's heads packed."""
    kinds = _FLOATS if pool.dtype == _FP8 else (pool.dtype,)
    return k.dtype == v.dtype and all(
        t.dtype in kinds and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
        for t in (k, v)
    )


def supports_decode_attention(pool: torch.Tensor, num_heads: int = 1) -> bool:
    """`num_heads` query heads over this pool [S, Hkv, D] (the kernel takes up to 64 query heads
    per KV head, D <= 1024)."""
    return (
        pool.device.type == "cpu"
        and num_heads // max(pool.shape[1], 1) <= 64
        and pool.dtype in _POOL_DTYPES
        and pool.shape[-1] % 8 == 0
        and pool.shape[-1] <= 1024
        and pool.is_contiguous()
        and load() is not None
    )


def rms_norm_supported(x: torch.Tensor) -> bool:
    """x [M, ..., D] with unit stride in the last dim and rows a fixed stride apart."""
    # is_cpu, not device.type: no torch.device object made (85 norms a step).
    return x.is_cpu and x.dtype in _FLOATS and x.stride(-1) == 1 and _loaded() is not None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    sum_into_x: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight * normalise(x [+ residual]) over the last dim; `weight` is [D] or [H, D] (per
    head: x is [T, H, D]). `rope`: (cos, signed sin) per token, [T, 1, D] in x's dtype, applied
    after (as rotary.apply_rotary; D <= 512). Returns (out, x + residual or None) as new
    contiguous tensors; with `sum_into_x` the sum is written over a contiguous x instead (one
    allocation fewer: each is a torch op, and a decode step's small ops are its overhead)."""
    lib = _loaded()
    assert lib is not None
    shape = x.shape
    d = shape[-1]
    # Rows: [T, D] at any token stride, or [T, H, D] with each token's H heads packed.
    if len(shape) == 2:
        rows, group = shape[0], 1
    else:
        rows = x.numel() // d
        group = shape[1] if len(shape) == 3 else 1
        if group > 1 and x.stride(1) != d:
            x = x.contiguous()
    contiguous = x.is_contiguous()
    # empty_like of a contiguous x: no shape to parse (~0.3 us less than torch.empty).
    out = torch.empty_like(x) if contiguous else torch.empty(*shape, dtype=x.dtype)
    res_in = res_out = None
    if residual is not None:
        if sum_into_x and contiguous:
            res_out = x
        else:
            res_out = torch.empty_like(x) if contiguous else torch.empty(*shape, dtype=x.dtype)
        res_in = residual.contiguous().data_ptr()
    w = weight.contiguous()
    cos = sin = None
    if rope is not None:
        cos, sin = rope[0].contiguous().data_ptr(), rope[1].contiguous().data_ptr()
    fn = lib.norm_bf16 if x.dtype == torch.bfloat16 else lib.norm_f32
    fn(
        x.data_ptr(),
        group,
        x.stride(0),
        res_in,
        res_out.data_ptr() if res_out is not None else None,
        w.data_ptr(),
        w.numel() // d,
        out.data_ptr(),
        rows,
        d,
        eps,
        cos,
        sin,
    )
    return out, res_out


def silu_mul_supported(x: torch.Tensor) -> bool:
    return (
        x.is_cpu
        and x.dtype in _FLOATS
        and x.dim() == 2
        and x.shape[1] % 2 == 0
        and x.is_contiguous()
        and _loaded() is not None
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I], in x's dtype."""
    lib = _loaded()
    assert lib is not None
    t, i2 = x.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=x.dtype)
    fn = lib.silu_mul_bf16 if x.dtype == torch.bfloat16 else lib.silu_mul_f32
    fn(x.data_ptr(), out.data_ptr(), t, i)
    return out


def kv_store_supported(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether kv_store (kv_store_fp8 for an fp8 pool) can write these rows ([T, Hkv, D], any
    token stride) into `pool` [S, Hkv, D]: on CPU, the pool's dtype (an fp8 pool: bf16 or fp32
    rows), each token's heads packed, the pool contiguous."""
    return (
        pool.device.type == "cpu"
        and pool.is_contiguous()
        and k.shape[1:] == pool.shape[1:]
        and v.shape[1:] == pool.shape[1:]
        and can_write_new(pool, k, v)
        and load() is not None
    )


def kv_store_fp8(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_store into fp8 e4m3 pools (see kv_store_supported): each value rounded as
    kv_pool.to_fp8 rounds it. Returns the values stored, in k's dtype ([T, Hkv, D]): what the
    pools give back."""
    lib = load()
    assert lib is not None and k_pool.dtype == _FP8 and k.dtype == v.dtype in _FLOATS
    k_back, v_back = torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)
    bf16 = int(k.dtype == torch.bfloat16)
    tail = (k_pool[0].numel(), bf16, k_back.data_ptr(), v_back.data_ptr())
    _store_rows(lib.kv_store_e4m3, k_pool, v_pool, slots, k, v, tail)
    return k_back, v_back


def kv_store(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_pool[slots] = k and v_pool[slots] = v (as index_copy_ along dim 0), rows copied where
    they lie (k and v are views of the fused qkv output: no gather into a packed tensor first).
    See kv_store_supported; slots int64 [T]. IndexError for a slot outside the pool, with
    nothing stored."""
    lib = load()
    assert lib is not None
    _store_rows(lib.kv_store, k_pool, v_pool, slots, k, v, (k_pool[0].numel() * k.element_size(),))


def _store_rows(
    fn: Any,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tail: tuple[int, ...],
) -> None:
    """One of csrc/elementwise.c's KV stores: the pools, the slots, the rows where they lie,
    then the store's own `tail` arguments; IndexError for a slot outside the pool."""
    slots = slots.to(torch.int64).contiguous()
    t, size = k.shape[0], k.element_size()
    assert slots.numel() == t == v.shape[0]
    rows = (k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, t)
    bad = fn(k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[0], slots.data_ptr(), *rows, *tail)
    if bad >= 0:
        raise IndexError(f"KV slot {int(slots[bad])} outside the pool of {k_pool.shape[0]}")


# qgemv's arguments (x, x_bf16, codes, code row stride, scales, zeros, group row stride, y,
# out_bf16, M, N, K, group size): every quantized matmul entry point takes them.
_QMM_ARGS: list[Any] = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
_QMM_ARGS += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
_QMM_ARGS += [ctypes.c_int64] * 4
# A weight's group mins as qmins.c and qamx's *_mins take them (common.h's Mins; QTensor's
# mins_args): the mins (fp32, or u8 m), their row stride, the compact form's dmin (0: none),
# its row stride, groups per dmin.
MINS_ARGS: list[Any] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
MINS_ARGS += [ctypes.c_int64]
# qamx's *_mins: the same with the mins' arguments after the zeros' group row stride.
_QMM_MINS_ARGS: list[Any] = _QMM_ARGS[:7] + MINS_ARGS + _QMM_ARGS[7:]
# qdequant's (codes, code row stride, scales, zeros, group row stride, out, first row, end
# row, K, group size): the row dequantizers.
_QROWS_ARGS: list[Any] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_QROWS_ARGS += [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 4


def _quant_kernels(lib: Any, prefix: str, kinds: tuple[str, ...], argtypes: list[Any]) -> dict:
    """The entry points `prefix`_<kind> the build has, by code kind, bound to `argtypes`."""
    out: dict[str, Any] = {}
    for kind in kinds:
        fn: Any = getattr(lib, f"{prefix}_{kind}", None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = None
            out[kind] = fn
    return out


def _tile_kernels(lib: Any, prefix: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The AMX entry points `prefix`_<kind> by code kind, where the build has them and
    `prefix`_ready() was granted the tiles (all take qgemv's arguments)."""
    ready: Any = getattr(lib, f"{prefix}_ready", None)
    if ready is None:
        return {}
    ready.restype = ctypes.c_int
    return _quant_kernels(lib, prefix, kinds, _QMM_ARGS) if ready() else {}
