"""One linear at a time: the quantized matmuls (int8, int4, fp8; minisgl/quant/cpu_gemv.py)
against the bf16 GEMV on the same shape, in the same run, weights cold (enough distinct ones
per pass to miss the caches, as in a decode step). Prints each one's best pass, its bytes'
read rate and its time over bf16's: ratios hold on a shared machine where absolute times do
not.

    python benchmarks/quant_linear.py --shape 3072x1024 --rows 1,8 --threads 2
    python benchmarks/quant_linear.py --shape 1024x3072 --rows 512 --prefill
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme

COLD_BYTES = 96 << 20


def _once(fn, clock) -> float:  # noqa: ANN001
    t0 = clock()
    fn()
    return clock() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="3072x1024", help="N x K (output x input features)")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefill", action="store_true", help="time the dequantize+GEMM paths")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: the process's CPU time (with --threads 1: leaves out time other work held "
        "the core)",
    )
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    count = max(2, COLD_BYTES // (n * k * 2))
    g = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=g).bfloat16() for _ in range(count)]
    quant = {m: [quantize(w, load_scheme(m)) for w in floats] for m in ("int8", "int4", "fp8")}
    threads = torch.get_num_threads()
    print(f"{n}x{k}, {count} distinct weights per pass, {threads} threads, {args.clock} clock")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, generator=g).bfloat16()
        cases = {"bf16 gemv": (lambda x=x: [cpu_kernels.gemv(x, w) for w in floats], n * k * 2)}
        if args.prefill:
            cases = {"bf16 gemm": (lambda x=x: [cpu_kernels.gemm(x, w) for w in floats], n * k * 2)}
        for m, ws in quant.items():
            nbytes = ws[0].nbytes()
            if args.prefill:
                cases[f"{m} dequant_gemm"] = (
                    lambda ws=ws, x=x: [cpu_gemv.dequant_gemm(x, w) for w in ws],
                    nbytes,
                )
                cases[f"{m} dequant_torch"] = (
                    lambda ws=ws, x=x: [cpu_gemv.dequant_torch(x, w) for w in ws],
                    nbytes,
                )
            else:
                cases[f"{m} qgemv"] = (
                    lambda ws=ws, x=x: [cpu_gemv.qgemv(x, w) for w in ws],
                    nbytes,
                )
        times = {name: float("inf") for name in cases}
        for fn, _ in cases.values():
            fn()  # warm-up
        for _ in range(args.reps):  # interleaved: a burst of other work hits them all alike
            for name, (fn, _) in cases.items():
                times[name] = min(times[name], _once(fn, clock))
        base = next(iter(times.values()))
        for name, (_, nbytes) in cases.items():
            t = times[name] / count
            print(
                f"rows {rows:4d} {name:<20} {t * 1e6:9.1f} us  {nbytes / t / 1e9:6.1f} GB/s  "
                f"{times[name] / base:5.2f}x the bf16 time"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
