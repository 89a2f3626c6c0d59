"""The machine's roofline, measured where the benchmarks run: read bandwidth and matmul peak.

A figure in tokens/s means little without the machine it came from (CPUs seen so far range from
AVX2-only at ~28 GB/s to AVX-512 + AMX at ~2 TFLOP/s bf16), so the benchmarks print the CPU, its
relevant flags, these two measurements, and each result as a fraction of what they allow:
- memory bound: bytes a step must read (weights once, plus the KV cache) / read bandwidth;
- compute bound: FLOPs of the step / the higher of the best matmul rate any of our candidates
  reaches here and the rate the FMA units issue fp32 multiply-adds (a ceiling no fp32 kernel
  passes: where a batch of B rows needs more than that, a B-row step cannot cost what a 1-row
  step does, however good the kernel).
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl import hugepages
from minisgl.layers import cpu_build, cpu_kernels, cpu_linear

FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclass
class Machine:
    cpu: str
    flags: str
    threads: int
    read_bytes_per_s: float
    matmul_flops: dict[str, float]  # dtype -> FLOP/s (best candidate, prefill-sized)
    matmul_by: dict[str, str]  # dtype -> which candidate reached it
    fma_flops: float | None = None  # fp32 FMA issue rate at the kernels' vector width
    read: ReadRate | None = None  # how read_bytes_per_s was measured (its loop, its spread)

    def describe(self) -> str:
        peaks = ", ".join(
            f"{d} matmul {f / 1e9:.0f} GFLOP/s ({self.matmul_by[d]})"
            for d, f in self.matmul_flops.items()
        )
        if self.fma_flops:
            peaks += f", fp32 FMA issue {self.fma_flops / 1e9:.0f} GFLOP/s"
        read = self.read.describe() if self.read else f"read {self.read_bytes_per_s / 1e9:.1f} GB/s"
        if self.read and self.read_bytes_per_s > self.read.best:  # a faster pass came later
            read += f", {self.read_bytes_per_s / 1e9:.1f} GB/s later in the run"
        return f"CPU: {self.cpu} [{self.flags}], {self.threads} threads; measured: {read}, {peaks}"

    def compute_flops(self, dtype: str) -> float:
        """The compute ceiling: the best matmul measured, or the FMA units' issue rate where
        that is higher (a kernel that multiplies in fp32 can reach it; none can pass it)."""
        return max(self.matmul_flops[dtype], self.fma_flops or 0.0)

    def floor_s(self, read_bytes: float, flops: float, dtype: str) -> tuple[float, str]:
        """The least time a step of this many bytes and FLOPs can take, and what bounds it."""
        mem = read_bytes / self.read_bytes_per_s
        comp = flops / self.compute_flops(dtype)
        return (mem, "memory") if mem >= comp else (comp, "compute")


# The read loops (stream.c): (bytes prefetched ahead by hand, into L2?, 32-byte loads?). The
# plain loop leaves it to the hardware prefetcher; the distances are our matmuls': panel512.c
# reads 2 KB ahead into L1, gemv.c two 4-row blocks ahead (16 KB at K = 1024) into L1, gemv512
# two 8-row blocks ahead (32 KB at K = 1024) into L2. The AVX-512 build also reads with AVX2's
# 32-byte loads (on the Zen 4 of docs/performance.md no slower than 64-byte ones).
READ_LOOPS: dict[str, tuple[int, int, int]] = {
    "plain": (0, 0, 0),
    "prefetch 2 KB to L1": (2048, 0, 0),
    "prefetch 16 KB to L1": (16384, 0, 0),
    "prefetch 32 KB to L2": (32768, 1, 0),
    "plain, 32-byte loads": (0, 0, 1),
}


@dataclass
class ReadRate:
    """The read bandwidth: the best pass of the best loop, where it came from, and the spread
    of that loop's passes (a VM whose memory is shared shows it here: the steps spread as much)."""

    best: float  # bytes/s, the fastest pass of any loop
    loop: str  # the loop that reached it
    median: float  # that loop's median pass
    plain: float  # the plain loop's fastest pass (best is never below it)
    passes: dict[str, list[float]]  # loop -> bytes/s of each pass, in order

    def describe(self) -> str:
        return (
            f"read {self.best / 1e9:.1f} GB/s ({self.loop}; median of its "
            f"{len(self.passes[self.loop])} passes {self.median / 1e9:.1f}, plain loop best "
            f"{self.plain / 1e9:.1f})"
        )


def read_rates(
    clock: Callable[[], float] = time.perf_counter, nbytes: int = 1 << 30, passes: int = 6
) -> ReadRate:
    """Bytes per second the threads read from memory, timed by `clock` (the kernels' clock):
    a buffer far larger than the caches, on huge pages as the weights are (hugepages.py; on
    4 KB pages a read pays a TLB walk per page: 1.1-1.2x slower on the Zen 4 of
    docs/performance.md), read by each loop of READ_LOOPS in turn, `passes` times over, at the
    build's vector width. The loops take turns pass by pass, so a burst of other work hits them
    all alike; the best pass counts (other work only ever adds time)."""
    lib = cpu_kernels.load()
    raw = _stream_lib()
    buf = hugepages.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)  # faults the pages in
    loops = dict(READ_LOOPS) if raw is not None else {"plain": (0, 0, 0)}
    if not (cpu_kernels.build_id() or "").startswith("avx512"):
        del loops["plain, 32-byte loads"]  # the plain loop already: AVX2 has no wider loads
    seen: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(passes):
        for name, (ahead, l2, narrow) in loops.items():
            t0 = clock()
            if raw is not None:
                raw.stream_read_ahead(buf.data_ptr(), buf.numel(), ahead, l2, narrow)
            elif lib is not None:
                lib.stream_read(buf.data_ptr(), buf.numel())
            else:
                buf.sum()
            seen[name].append(buf.numel() * 4 / max(clock() - t0, 1e-9))
    loop = max(seen, key=lambda name: max(seen[name]))
    return ReadRate(max(seen[loop]), loop, statistics.median(seen[loop]), max(seen["plain"]), seen)


def _stream_lib() -> ctypes.CDLL | None:
    """The kernels' library with stream_read_ahead declared (a benchmark-only entry point that
    cpu_kernels does not bind), or None without kernels."""
    path = cpu_kernels._LIB_PATH if cpu_kernels.load() is not None else None
    if path is None:
        return None
    raw = ctypes.CDLL(str(path))  # the same handle as cpu_kernels' (the loader counts opens)
    raw.stream_read_ahead.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    raw.stream_read_ahead.argtypes += [ctypes.c_int, ctypes.c_int]
    raw.stream_read_ahead.restype = ctypes.c_float
    return raw


def read_bandwidth(clock: Callable[[], float]) -> float:
    """Bytes per second the threads read from memory (read_rates' best), timed by `clock`."""
    return read_rates(clock).best


def _matmul_peak(
    dtype: torch.dtype, clock: Callable[[], float], m: int = 512, n: int = 4096, k: int = 2048
) -> tuple[float, str]:
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k).to(dtype)
    best: tuple[float, str] = (float("inf"), "")
    for name in cpu_linear.available(w, dtype):
        packed = cpu_linear.pack(name, w)
        run = cpu_linear._RUN[name]
        run(x, w, packed, None)
        for _ in range(3):
            t0 = clock()
            run(x, w, packed, None)
            best = min(best, (clock() - t0, name))
    return 2.0 * m * n * k / best[0], best[1]


def cpu_description() -> str:
    """The CPU model, its flags of note and the thread counts: printed next to every figure."""
    model, flags = cpu_build.cpu_info()
    noted = " ".join(f for f in FLAGS_OF_NOTE if f in flags) or "no AVX2"
    return f"{model}; flags: {noted}; {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}"


def measure(
    dtypes: tuple[str, ...] = ("bfloat16",), clock: Callable[[], float] = time.perf_counter
) -> Machine:
    """`clock`: time.process_time with one thread leaves out time other work held the core."""
    model, flags = cpu_build.cpu_info()
    noted = " ".join(f for f in FLAGS_OF_NOTE if f in flags) or "no AVX2"
    peaks, by = {}, {}
    for d in dtypes:
        peaks[d], by[d] = _matmul_peak(getattr(torch, d), clock)
    read = read_rates(clock)
    return Machine(
        model, noted, torch.get_num_threads(), read.best, peaks, by, cpu_kernels.fma_flops(), read
    )


def linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of the matmul weights a forward step streams (the LM head included,
    tied or not)."""
    from minisgl.quant.weight import QuantWeight

    params = nbytes = 0
    for m in model.modules():
        if not hasattr(m, "kernel_out_dtype") or m.weight is None:
            continue  # (None: a weight held in parts, each a module counted here)
        if isinstance(m.weight, QuantWeight):  # codes, scales and zero points
            params += math.prod(m.weight.shape)
            nbytes += m.weight.nbytes()
        else:
            params += m.weight.numel()
            nbytes += m.weight.numel() * m.weight.element_size()
    return params, nbytes
