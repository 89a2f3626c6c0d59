"""The quantized GEMV (csrc/qgemv.c) one linear at a time, against the bf16 kernels (gemv,
panel, and where the build and the CPU have them gemv512 and amx) on the same shape in the same run, at decode row counts, with the read bandwidth
measured in the same run: for each format, the rate its bytes stream at and that rate over the
machine's (the share of its own roofline), and its time over the faster bf16 kernel's.

Weights are cold as in a decode step: each pass cycles over enough distinct copies to miss the
last-level cache. Codes are random (the kernels' speed does not depend on the values), so the
8B shapes need no quantizing pass.

    python benchmarks/qgemv_bench.py --shapes 3072x1024,1024x3072 --rows 1,2,4,8,16
    python benchmarks/qgemv_bench.py --shapes 12288x4096 --rows 1,8 --formats int8,int4
    python benchmarks/qgemv_bench.py --formats none --threads 1 --clock cpu  # bf16 kernels only
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import sys
import time
from pathlib import Path

import torch
from roofline import read_bandwidth

from minisgl import hugepages
from minisgl.layers import cpu_build, cpu_kernels
from minisgl.quant import cpu_gemv, cpu_panel
from minisgl.quant.loading import move_to_huge_pages
from minisgl.quant.qtensor import FP8, QTensor


def cold_bytes() -> int:
    """Bytes of weight copies to cycle over so that none is still cached: twice the largest
    cache sysfs reports (480 MiB of L3 on a recent Xeon), at least 80 MiB."""
    largest = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = Path(path).read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        largest = max(largest, int(text.rstrip("KMG")) * scale)
    return max(80 << 20, 2 * largest)


SHAPES = "3072x1024,1024x3072,1024x2048,12288x4096"  # Qwen3-0.6B gate/up, down, o; 8B gate/up
FORMATS = ("int8", "int4", "fp8")


def random_weight(fmt: str, n: int, k: int, g: torch.Generator) -> QTensor:
    """A weight in the layout --quantization makes (int8 per channel, int4 and fp8 group 128)."""
    if fmt == "int8":
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        zeros = torch.full((n, 1), 128, dtype=torch.uint8)
        return QTensor(codes, torch.rand(n, 1, generator=g) * 1e-2, zeros, None, 8, 0, k)
    groups = k // 128
    scales = torch.rand(n, groups, generator=g) * 1e-2
    if fmt == "int4":
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
        return QTensor(codes, scales, zeros, None, 4, 128, k)
    # As a block-scaled checkpoint's codes: a normal spread whose largest are near 448. Random
    # bytes would make 1 code in 16 subnormal (this spread: ~1 in 10^4), and the fp32 forms of
    # subnormals cost qgemv a microcode assist each (~15x slower).
    codes = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    return QTensor(codes, scales, None, None, 8, 128, k)


def onto_huge_pages(w: QTensor) -> QTensor:
    """w moved onto huge pages in place, as a loaded model's weights are and as the bf16
    weights here are, so the formats are compared on equal terms (left on 4 KB pages, the
    quantized stream paid a TLB miss per 4 KB that the bf16 one did not)."""
    move_to_huge_pages(w)
    return w


def gemv512_l1(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """cpu_kernels.gemv512 with its prefetch into L1 (T0) instead of L2 (T1)."""
    lib = cpu_kernels.load()
    assert lib is not None and lib.gemv512_prefetch_l1 is not None
    lib.gemv512_prefetch_l1.value = 1
    try:
        return cpu_kernels.gemv512(x, w)
    finally:
        lib.gemv512_prefetch_l1.value = 0


@functools.cache
def qgemv_switch(name: str) -> ctypes.c_int:
    """One of qgemv.c's switches (looked up once: loading the library per call costs more than
    a small call)."""
    return ctypes.c_int.in_dll(ctypes.CDLL(str(cpu_kernels._LIB_PATH)), name)


def qgemv_switched(name: str, value: int, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """cpu_gemv.qgemv with qgemv.c's switch `name` at `value` for the call."""
    switch = qgemv_switch(name)
    saved, switch.value = switch.value, value
    try:
        return cpu_gemv.qgemv(x, w)
    finally:
        switch.value = saved


def qgemv_int16(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """One row of x as int16 (VPDPWSSD) instead of bytes (VPDPBUSD, where the build has
    AVX512-VNNI)."""
    return qgemv_switched("qgemv_byte_path", 0, x, w)


def qgemv_x8(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x in 8 bits against integer codes (--cpu-quantized-activations int8)."""
    return qgemv_switched("qgemv_x8", 1, x, w)


def timed(fn, clock) -> float:  # noqa: ANN001
    t0 = clock()
    fn()
    return clock() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=SHAPES, help="N x K (output x input features), commas")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 kernels")
    ap.add_argument(
        "--int16",
        action="store_true",
        help="also integer codes against x as int16 where one row runs as bytes (the two paths "
        "side by side)",
    )
    ap.add_argument(
        "--x8",
        action="store_true",
        help="also integer codes against x in 8 bits (--cpu-quantized-activations int8) where "
        "the build takes them, side by side",
    )
    ap.add_argument(
        "--hot",
        action="store_true",
        help="one copy of each weight, cached: the kernels' issue rate without memory's limit",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: the process's CPU time (with --threads 1 on a shared machine: leaves out "
        "time other work held the core)",
    )
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cold = 0 if args.hot else cold_bytes()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f not in ("", "none")]
    read = read_bandwidth(clock)  # on the kernels' clock
    print(
        f"CPU: {cpu_build.cpu_info()[0]}, build {cpu_kernels.build_id()}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, {'hot' if args.hot else 'cold'} "
        f"weights, read {read / 1e9:.1f} GB/s (measured now)"
    )
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        cases: dict[str, tuple[list, int]] = {}
        if not args.no_bf16:
            count = max(1 if args.hot else 2, -(-cold // (n * k * 2)))
            # On huge pages as the panels are (panel_pack): the layouts compared on equal terms.
            floats = [
                hugepages.empty(n, k, dtype=torch.bfloat16).copy_(torch.randn(n, k, generator=g))
                for _ in range(count)
            ]
            panels = [cpu_kernels.panel_pack(w) for w in floats]
            cases["bf16 gemv"] = ([(cpu_kernels.gemv, w) for w in floats], n * k * 2)
            cases["bf16 panel"] = ([(cpu_kernels.panel, p) for p in panels], n * k * 2)
            if cpu_kernels.supports_gemv512(torch.bfloat16, floats[0]):
                cases["bf16 gemv512"] = ([(cpu_kernels.gemv512, w) for w in floats], n * k * 2)
                # The same with its prefetch into L1 rather than L2.
                t0 = [(gemv512_l1, w) for w in floats]
                cases["bf16 gemv512 T0"] = (t0, n * k * 2)
            if cpu_kernels.supports_amx(torch.bfloat16, floats[0]):
                cases["bf16 amx"] = ([(cpu_kernels.amx, w) for w in floats], n * k * 2)
        for fmt in formats:
            w0 = random_weight(fmt, n, k, g)
            count = max(1 if args.hot else 2, -(-cold // w0.nbytes()))
            ws = [w0] + [random_weight(fmt, n, k, g) for _ in range(count - 1)]
            for w in ws:
                onto_huge_pages(w)
            cases[fmt] = ([(cpu_gemv.qgemv, w) for w in ws], w0.nbytes())
            if args.int16 and fmt != "fp8":
                cases[f"{fmt} int16"] = ([(qgemv_int16, w) for w in ws], w0.nbytes())
            if args.x8 and cpu_gemv.takes_int8_activations(w0):
                cases[f"{fmt} x8"] = ([(qgemv_x8, w) for w in ws], w0.nbytes())
            lib = cpu_kernels.load()
            if lib is not None and cpu_gemv.kind(w0) in lib.qamxi:  # AMX from the codes
                cases[f"{fmt} amx"] = ([(cpu_panel.amx_int, w) for w in ws], w0.nbytes())
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g).bfloat16()
            runs = {
                name: (lambda pairs=pairs, x=x: [fn(x, w) for fn, w in pairs])
                for name, (pairs, _) in cases.items()
            }
            times = {name: float("inf") for name in runs}
            for fn in runs.values():
                fn()  # warm-up
            for _ in range(args.reps):  # interleaved: a burst of other work hits them all
                for name, fn in runs.items():
                    times[name] = min(times[name], timed(fn, clock) / len(cases[name][0]))
            bf16 = min((t for name, t in times.items() if name.startswith("bf16")), default=None)
            for name, t in times.items():
                nbytes = cases[name][1]
                rel = f"{t / bf16:5.2f}x bf16" if bf16 else ""
                print(
                    f"{n}x{k} rows {rows:3d} {name:<15} {t * 1e6:9.1f} us {nbytes / t / 1e9:6.1f}"
                    f" GB/s {nbytes / t / read:5.0%} of read  {rel}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
