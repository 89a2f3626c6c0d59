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

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

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

    def describe(self) -> str:
        peaks = ", ".join(
            f"{d} matmul {f / 1e9:.0f} GFLOP/s ({self.matmul_by[d]})"
            for d, f in self.matmul_flops.items()
        )
        if self.fma_flops:
            peaks += f", fp32 FMA issue {self.fma_flops / 1e9:.0f} GFLOP/s"
        return (
            f"CPU: {self.cpu} [{self.flags}], {self.threads} threads; measured: read "
            f"{self.read_bytes_per_s / 1e9:.1f} GB/s, {peaks}"
        )

    def compute_flops(self, dtype: str) -> float:
        """The compute ceiling: the best matmul measured, or the FMA units' issue rate where
        that is higher (a kernel that multiplies in fp32 can reach it; none can pass it)."""
        return max(self.matmul_flops[dtype], self.fma_flops or 0.0)

    def floor_s(self, read_bytes: float, flops: float, dtype: str) -> tuple[float, str]:
        """The least time a step of this many bytes and FLOPs can take, and what bounds it."""
        mem = read_bytes / self.read_bytes_per_s
        comp = flops / self.compute_flops(dtype)
        return (mem, "memory") if mem >= comp else (comp, "compute")


def read_bandwidth(clock: Callable[[], float]) -> float:
    """Bytes per second the threads read from memory, timed by `clock` (the kernels' clock)."""
    lib = cpu_kernels.load()
    buf = torch.ones(1 << 28)  # 1 GiB
    best = float("inf")
    for _ in range(4):  # the first pass also faults the pages in
        t0 = clock()
        if lib is not None:
            lib.stream_read(buf.data_ptr(), buf.numel())
        else:
            buf.sum()
        best = min(best, clock() - t0)
    return buf.numel() * 4 / best


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
    bandwidth = read_bandwidth(clock)
    return Machine(
        model, noted, torch.get_num_threads(), bandwidth, peaks, by, cpu_kernels.fma_flops()
    )


def linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of the matmul weights a forward step streams (the LM head included,
    tied or not)."""
    from minisgl.quant.weight import QuantWeight

    params = nbytes = 0
    for m in model.modules():
        if not hasattr(m, "kernel_out_dtype"):
            continue
        if isinstance(m.weight, QuantWeight):  # codes, scales and zero points
            params += math.prod(m.weight.shape)
            nbytes += m.weight.nbytes()
        else:
            params += m.weight.numel()
            nbytes += m.weight.numel() * m.weight.element_size()
    return params, nbytes
