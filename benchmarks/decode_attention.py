"""Decode attention alone: the C kernel against torch's SDPA on the same pools, and against the
read loop over as many bytes.

B requests of --context keys each (one query per request, as a decode step has them), the
heads of Qwen3-0.6B by default, --layers layers' key and value pools on huge pages (as the
server's pool is), each request's keys on pages of --page-size slots in shuffled order (a pool
that has served a while). "cold" walks every layer's pools in turn, as a decode step does (from
memory where the layers' bytes exceed the caches: B=1 x 65 keys is 7.5 MB and does not);
"cached" attends one layer's pools again and again. The peer, in the same run: torch's
scaled_dot_product_attention over the requests' keys and values gathered from the pools (what
the pure-PyTorch path costs). The read loop
(roofline.py) gives the least time those bytes take from memory. Repeats take turns, so noise
hits every case alike; the best and the median are printed.

    python benchmarks/decode_attention.py --batches 1,8,32 --context 65
    python benchmarks/decode_attention.py --batches 8 --context 1024 --kv-dtype fp8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import cpu_description, read_rates  # noqa: E402

from minisgl import hugepages  # noqa: E402
from minisgl.layers import cpu_kernels  # noqa: E402

KV_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


@dataclass
class Pools:
    """Every layer's key and value pools and the batch's slots in them."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slots: torch.Tensor  # [B, context] int64
    lens: torch.Tensor  # [B] int64

    @property
    def nbytes(self) -> int:
        """The bytes of keys and values one pass over all layers reads."""
        b, n = self.slots.shape
        row = self.keys[0][0].numel() * self.keys[0].element_size()
        return 2 * len(self.keys) * b * n * row


def make_pools(args: argparse.Namespace, batch: int, gen: torch.Generator) -> Pools:
    pages = (args.context + args.page_size - 1) // args.page_size
    total = batch * pages + 1
    shape = (total * args.page_size, args.kv_heads, args.head_dim)
    dtype = KV_DTYPES[args.kv_dtype]

    def pool() -> torch.Tensor:
        t = hugepages.empty(*shape, dtype=dtype)
        t.copy_(torch.randn(*shape, generator=gen).to(dtype))
        return t

    keys = [pool() for _ in range(args.layers)]
    values = [pool() for _ in range(args.layers)]
    order = torch.randperm(total, generator=gen)[: batch * pages].view(batch, pages)
    within = torch.arange(args.page_size)
    slots = (order[:, :, None] * args.page_size + within).reshape(batch, -1)[:, : args.context]
    lens = torch.full((batch,), args.context, dtype=torch.int64)
    return Pools(keys, values, slots.contiguous(), lens)


def kernel_layer(q: torch.Tensor, p: Pools, layer: int, scale: float) -> torch.Tensor:
    return cpu_kernels.decode_attention(q, p.keys[layer], p.values[layer], p.slots, p.lens, scale)


def sdpa_layer(q: torch.Tensor, p: Pools, layer: int, scale: float) -> torch.Tensor:
    """The peer: the requests' keys and values gathered, then torch's attention."""
    k = p.keys[layer][p.slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, n, D]
    v = p.values[layer][p.slots].to(q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


Layer = Callable[[torch.Tensor, Pools, int, float], torch.Tensor]


def timed_pass(fn: Layer, q: torch.Tensor, pools: Pools, layers: list[int], scale: float) -> float:
    """Seconds one pass of `fn` over these layers' pools takes."""
    t0 = time.perf_counter()
    for i in layers:
        fn(q, pools, i, scale)
    return time.perf_counter() - t0


def measure_batch(
    args: argparse.Namespace, batch: int, read_rate: float, gen: torch.Generator
) -> None:
    pools = make_pools(args, batch, gen)
    q_dtype = torch.float32 if args.kv_dtype == "fp32" else torch.bfloat16
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(q_dtype)
    scale = args.head_dim**-0.5
    # The kernel answers what torch's attention answers (bf16: up to its rounding).
    torch.testing.assert_close(
        kernel_layer(q, pools, 0, scale).float(),
        sdpa_layer(q, pools, 0, scale).float(),
        rtol=3e-2,
        atol=3e-2,
    )
    every, first = list(range(args.layers)), [0] * args.layers
    cases: dict[str, tuple[Layer, list[int]]] = {
        "C kernel, cold": (kernel_layer, every),
        "C kernel, cached": (kernel_layer, first),
        "torch SDPA, cold": (sdpa_layer, every),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, layers in cases.values():
        timed_pass(fn, q, pools, layers, scale)  # warm-up: scratch, pages, threads
    for _ in range(args.repeats):
        for name, (fn, layers) in cases.items():
            times[name].append(timed_pass(fn, q, pools, layers, scale))
    nbytes = pools.nbytes
    print(
        f"B={batch} x {args.context} keys, {args.layers} layers, {args.kv_dtype} pools "
        f"(pages of {args.page_size}, shuffled): {nbytes / 1e6:.1f} MB of keys and values "
        f"a pass; from memory at the read loop's rate {nbytes / read_rate * 1e3:.2f} ms"
    )
    sdpa = min(times["torch SDPA, cold"])
    for name, ts in times.items():
        best = min(ts)
        print(
            f"  {name:<18} best {best * 1e3:8.2f} ms  median {statistics.median(ts) * 1e3:8.2f}"
            f" ms  {nbytes / best / 1e9:6.1f} GB/s ({nbytes / best / read_rate:4.0%} of the "
            f"read loop)  {sdpa / best:5.2f}x SDPA's speed"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=65, help="keys per request")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--read-mb", type=int, default=1024, help="the read loop's buffer")
    args = ap.parse_args(argv)
    if cpu_kernels.load() is None:
        print("no CPU kernels in this environment: nothing to measure")
        return 1
    gen = torch.Generator().manual_seed(0)
    print(cpu_description())
    read = read_rates(nbytes=args.read_mb << 20, passes=3)
    print(f"read loop: {read.best / 1e9:.1f} GB/s ({read.loop})")
    for batch in (int(b) for b in args.batches.split(",")):
        measure_batch(args, batch, read.best, gen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
