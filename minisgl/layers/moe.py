"""Mixture of experts: the router's top-k choice and a fused forward over the chosen experts.

Weights are fused per layer: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I]. Under tensor parallelism every rank holds every expert's slice of the
intermediate dimension (I / tp of gate, of up and of down's inputs), so, as for a dense MLP,
each rank's output is a partial sum that one all-reduce completes.

The forward groups the batch's (token, expert) pairs by expert and runs one SwiGLU MLP per
expert that at least one token chose, over that expert's contiguous weights, then scatters the
results back weighted by the router. Experts no token chose are never read: a batch-1 decode
step streams k of E experts per layer (8 of 128 for Qwen3-30B-A3B), which is what puts
single-stream MoE decode near the memory roofline of the *active* parameters. On CUDA the
same is two grouped GEMMs (grouped_moe) where torch's kernel takes the operands.

At decode on the CPU (a few tokens, where the experts' matmul is the GEMV) with bf16 experts
the whole layer is one C call (cpu_kernels.moe_decode): the chosen experts' weight blocks shared
among the threads in one parallel region, the prefetch running on from one expert into the
next, instead of two GEMV calls, a SiLU and their Python per expert. Each expert's rows are the
same GEMV arithmetic, so the result is the same bits as the loop's. Quantized experts on the
quantized GEMV, or repacked into the VNNI panels (whose kernel serves every row count), are one
call too (cpu_kernels.moe_decode_q): there whole experts are shared among the threads, each
through the same kernel call the loop makes. The router's top-k at decode is one C call too
(cpu_kernels.moe_route), and the decode chain (cpu_chain.Chain.moe) makes the same three calls.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import distributed
from minisgl.layers import cpu_kernels, cpu_linear, kernel_choice
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.cpu_linear import native_bf16, onednn_gemm_enabled
from minisgl.quant import cpu_gemv
from minisgl.quant.cpu_choice import PACKED, QuantKernel, kernel_fn
from minisgl.quant.weight import QuantWeight

logger = logging.getLogger(__name__)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in fp32), the top-k per token, optionally renormalised to sum 1.

    router_logits [T, E] -> (weights [T, k] in out_dtype, expert ids [T, k] int64). Ties go to
    the lower expert id (torch.topk's order on CPU and CUDA alike is not promised, so the choice
    is made explicit: a stable descending sort). On the CPU at decode (up to
    cpu_kernels.MAX_ROWS tokens) one C call (cpu_kernels.moe_route, the decode chain's too),
    not ~8 torch ops a layer.
    """
    if router_logits.shape[0] <= cpu_kernels.MAX_ROWS and cpu_kernels.moe_route_supported(
        router_logits, top_k
    ):
        return cpu_kernels.moe_route(router_logits, top_k, renormalize, out_dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


# An expert's matmul: run(x [M, K], w [N, K]) -> x @ w.T (w a tensor, or a QTensor view of
# quantized experts).
MatMul = Callable[[torch.Tensor, Any], torch.Tensor]
# Stacked experts' weights [E, N, K]: float, or quantized (minisgl/quant/).
Experts = torch.Tensor | QuantWeight


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for one expert's contiguous [N, K] weight where nothing was measured
    (FusedMoE.prepare_cpu_kernels not run, or tuning off), by the untuned policy of the dense
    layers (cpu_linear.py): the CPU GEMV for decode-sized inputs (it streams bf16 weights at
    memory speed); for more rows our fp32-compute GEMM, except bf16 on CPUs that multiply bf16
    natively, where oneDNN's bf16 GEMM behind F.linear does twice the FLOPs per instruction
    (measured ~3x faster at 60-256 rows on Zen 4); F.linear elsewhere (CUDA, fp16)."""
    if cpu_kernels.supports(w):
        if x.shape[0] <= cpu_kernels.MAX_ROWS:
            return cpu_kernels.gemv(x, w)
        if not (w.dtype == torch.bfloat16 and _native_bf16_gemm()):
            return cpu_kernels.gemm(x, w)
    return F.linear(x, w)


def _grouped_gemm_works(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether this device runs the grouped GEMM path: CUDA only, and only where torch's
    kernel takes these operands (bf16 on recent GPUs; elsewhere it raises, and the
    per-expert loop is used)."""
    if x.device.type != "cuda":
        return False
    try:
        e, n, k = w13.shape
        probe = torch.zeros(e, k, dtype=x.dtype, device=x.device)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=x.device)
        torch._grouped_mm(probe, w13.transpose(1, 2), offs=offs)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        logger.info("grouped GEMM unavailable here (%s): experts run one by one", exc)
        return False
    return True


@functools.cache
def _native_bf16_gemm() -> bool:
    return native_bf16() and onednn_gemm_enabled()


def fused_moe(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    mm13: MatMul = _matmul,
    mm2: MatMul = _matmul,
    one_call_tokens: int | None = None,
    names: RowNames | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t -> [T, H] in x's dtype;
    `mm13`/`mm2` multiply by one expert's w13/w2 (the kernels measured fastest per row count).

    The per-expert work is just the two matmuls and the activation; gathering, weighting and
    the scatter back are one op each per layer, not per expert (on a busy 2-core CPU every
    small op is a parallel region costing tens of microseconds).

    Up to `one_call_tokens` tokens (where mm13 and mm2 run the CPU GEMV for every row count up
    to it) the experts run as one call (cpu_kernels.moe_decode), the same bits; None: as the
    default matmuls do (the GEMV up to cpu_kernels.MAX_ROWS rows), 0 with any others. `names`:
    mm13's and mm2's pick per row count, where other GEMVs than `gemv` may be one call too
    (decode_call)."""
    t, k = ids.shape
    call = decode_call(x, w13, w2, mm13, mm2, one_call_tokens, names)
    if call is not None:
        return call.run(x, weights, ids)
    flat = ids.reshape(-1)
    if t == 1:  # decode at batch 1: k distinct experts, no sort or gather needed
        outs = [_expert(x, w13, w2, e, mm13, mm2) for e in flat.tolist()]
        ys = torch.cat(outs).float() * weights.reshape(-1, 1).float()
        return ys.sum(0, keepdim=True).to(x.dtype)
    order, ends = _group_by_expert(flat, w13.shape[0])
    xs = x.index_select(0, order // k)
    outs, start = [], 0
    for e, end in enumerate(ends.tolist()):  # the loop's one read of the routing (a sync on GPUs)
        if end > start:
            outs.append(_expert(xs[start:end], w13, w2, e, mm13, mm2))
            start = end
    return _combine(torch.cat(outs), weights, order, x.dtype)


# Float experts' GEMV pick per row count (kernel_choice.row_table), for w13 and for w2.
RowNames = tuple[list[str], list[str]]


class OneCall(NamedTuple):
    """fused_moe's experts as one C call (csrc/moe.c), `kind`: "bf16" (moe_decode, w13 and w2
    the experts' bf16 tensors), "q" (moe_decode_q, quantized experts' kernel and operand
    words) or "f" (moe_decode_f, float experts' per-row-count GEMV words)."""

    kind: str
    w13: torch.Tensor
    w2: torch.Tensor
    experts: int
    inter: int  # w2's input features

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "q":
            return cpu_kernels.moe_decode_q(x, self.w13, self.w2, self.experts, weights, ids)
        if self.kind == "f":
            args = (self.experts, self.inter, weights, ids)
            return cpu_kernels.moe_decode_f(x, self.w13, self.w2, *args)
        return cpu_kernels.moe_decode(x, self.w13, self.w2, weights, ids)


def decode_call(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    mm13: MatMul,
    mm2: MatMul,
    one_call_tokens: int | None = None,
    names: RowNames | None = None,
) -> OneCall | None:
    """How fused_moe runs x's tokens as one C call, or None: the per-expert loop. The decode
    chain makes the same call. Up to one_call_tokens (see fused_moe) through `gemv`'s blocks
    (bf16 experts) or each quantized expert's kernel; float experts whose picks per row count
    (`names`) are other GEMVs (gemv512) each through those."""
    if one_call_tokens is None:
        one_call_tokens = _gemv_tokens(w13, w2, mm13, mm2)
    t = x.shape[0]
    if isinstance(w13, QuantWeight) and isinstance(w2, QuantWeight):
        if t > one_call_tokens:
            return None
        q13, q2 = _q_operands(x, w13), _q_operands(x, w2)
        if q13 is None or q2 is None or t > min(q13[1], q2[1]):
            return None
        return OneCall("q", q13[0], q2[0], w13.experts, w2.in_features)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return None
    experts, inter = w13.shape[0], w2.shape[2]
    if t <= one_call_tokens and cpu_kernels.supports_moe_decode(x, w13, w2):
        return OneCall("bf16", w13, w2, experts, inter)
    if names is None or not _f_takes(x, w13, w2):
        return None
    f13, rows13 = _f_words(w13, x.dtype, tuple(names[0][1 : cpu_kernels.MAX_ROWS + 1]))
    f2, rows2 = _f_words(w2, x.dtype, tuple(names[1][1 : cpu_kernels.MAX_ROWS + 1]))
    return OneCall("f", f13, f2, experts, inter) if t <= min(rows13, rows2) else None


def _f_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """moe_decode_f's shapes: x [T, H] bf16 or fp32, contiguous [E, 2I, H] and [E, H, I]
    experts on the CPU, H and I multiples of 16 (its weighting's and SiLU's vectors)."""
    if not (x.is_cpu and x.dim() == 2 and w13.dim() == w2.dim() == 3):
        return False
    e, i2, h = w13.shape
    return (
        x.dtype in (torch.bfloat16, torch.float32)
        and all(w.is_cpu and w.is_contiguous() for w in (w13, w2))
        and tuple(w2.shape) == (e, h, i2 // 2)
        and x.shape[1] == h
        and h % 16 == 0
        and (i2 // 2) % 16 == 0
        and cpu_kernels.load() is not None
    )


def _f_words(
    w: torch.Tensor, x_dtype: torch.dtype, names: tuple[str, ...]
) -> tuple[torch.Tensor, int]:
    """moe_decode_f's words for experts w [E, N, K] whose pick for M rows is names[M - 1], and
    up to how many rows every pick is a GEMV it calls (csrc/moe.c: weights, bytes per expert,
    N, K, then per row count the kernel's address and form). Once per weight and x dtype."""
    cache = w.__dict__.setdefault("_moe_f_words", {})
    key = (x_dtype, names, w.data_ptr())
    if key not in cache:
        e, n, k = w.shape
        words = [w.data_ptr(), w[0].numel() * w.element_size(), n, k]
        rows = 0
        for name in names:
            kernel = cpu_linear.gemv_call(name, x_dtype, w.dtype)
            if kernel is None:
                break
            words += kernel
            rows += 1
        words += [0, 0] * (cpu_kernels.MAX_ROWS - rows)
        cache[key] = torch.tensor(words, dtype=torch.int64), rows
    return cache[key]


def _gemv_rows(names: list[str], gemv: str = "gemv") -> int:
    """The row counts 1..r (r <= cpu_kernels.MAX_ROWS) that all run the GEMV (`gemv`), by the
    pick per row count (kernel_choice.row_table): r."""
    for rows in range(1, cpu_kernels.MAX_ROWS + 1):
        if names[rows] != gemv:
            return rows - 1
    return cpu_kernels.MAX_ROWS


def _gemv_tokens(w13: Experts, w2: Experts, mm13: MatMul, mm2: MatMul) -> int:
    """Up to how many tokens mm13 and mm2 run one C kernel on every row count: the GEMV by the
    default matmuls' untuned policy; quantized experts' own matmul: cpu_kernels.MAX_ROWS, as
    far as their kernels' words allow (_q_operands); 0 for anything else."""
    if isinstance(w13, QuantWeight) and isinstance(w2, QuantWeight):
        if mm13 != w13.expert_matmul or mm2 != w2.expert_matmul:
            return 0
        return cpu_kernels.MAX_ROWS
    return cpu_kernels.MAX_ROWS if mm13 is mm2 is _matmul else 0


def _q_names(w: QuantWeight) -> tuple[str, ...] | None:
    """The quantized pick the per-expert loop runs for 1, 2, ... cpu_kernels.MAX_ROWS rows:
    the kernel's picks (the packed kernels' where they were packed: QuantWeight.pack_vnni), the
    panels' own where packed without one, the quantized GEMV under qlinear's untuned policy (no
    kernel)."""
    if isinstance(w.kernel, QuantKernel):
        return _names_of(w.kernel.picks)
    if w.packed:
        return (PACKED,) * cpu_kernels.MAX_ROWS
    if w.kernel is None:
        return ("qgemv",) * cpu_kernels.MAX_ROWS
    return None


@functools.cache
def _names_of(picks: tuple[str, ...]) -> tuple[str, ...]:
    """The picks per row count 1..cpu_kernels.MAX_ROWS, once per picks: the row table they
    are read from took ~1.5 ms of a 12 ms Qwen3-30B-A3B-shaped 4-layer step (Zen 4) when it
    was built for every layer and step."""
    return tuple(kernel_choice.row_table(picks)[1 : cpu_kernels.MAX_ROWS + 1])


def _q_operands(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, int] | None:
    """Quantized experts' operands and kernel per row count as moe_decode_q takes them
    (csrc/moe.c), and up to how many rows an expert may have in that call (the row counts whose
    pick is one C kernel call); None where the quantized GEMV does not take them
    (cpu_gemv.usable), x is neither bf16 nor fp32 or no row count is one call. Made once per
    kind of x, place of the weight's tensors and picks: a decode step asks in every layer."""
    cache = w.__dict__.setdefault("_moe_operands", {})
    picks = w.kernel.picks if isinstance(w.kernel, QuantKernel) else None
    key = (
        x.dtype,
        x.device.type,
        x.dim(),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        w.packed,
        picks,
    )
    if key not in cache:
        cache[key] = _q_words(x, w)
    return cache[key]


def _q_words(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, int] | None:
    lib = cpu_kernels.load()
    if lib is None or x.dtype not in (torch.bfloat16, torch.float32) or not w.experts:
        return None
    one = w.view(0)
    names = _q_names(w)
    # packed: the panels' kernels take them (8-bit codes in groups of 16 only they take)
    if names is None or not (w.packed or cpu_gemv.usable(x, one)):
        return None
    kind, x_bf16 = cpu_gemv.kind(one), int(x.dtype == torch.bfloat16)
    kernels = []
    for name in names:  # as far as every row count is one C call
        fn = kernel_fn(lib, name, kind, x_bf16)
        if fn is None:
            break
        kernels.append(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    codes, scales, zeros = w.codes, w.scales, w.zeros
    if not kernels or not (codes.is_contiguous() and scales.is_contiguous()):
        return None
    words = [codes.data_ptr(), codes.stride(0) * codes.element_size()]
    words += [codes.stride(1) * codes.element_size(), scales.data_ptr()]
    words += [scales.stride(0) * scales.element_size()]
    words += (
        [zeros.data_ptr(), zeros.stride(0) * zeros.element_size()] if zeros is not None else [0, 0]
    )
    words += [scales.stride(1), codes.shape[1], w.in_features, w.group_size or w.in_features]
    words += _mins_words(w)
    words += kernels + [0] * (cpu_kernels.MAX_ROWS - len(kernels))
    return torch.tensor(words, dtype=torch.int64), len(kernels)


def _mins_words(w: QuantWeight) -> list[int]:
    """moe.c's words of the experts' group mins (GGUF's K-quants: their term after each expert's
    kernel): QTensor.mins_args' with the bytes an expert after each pointer; all 0: no mins."""
    m, d = w.mins, w.mins_scales
    if m is None:
        return [0] * 7
    mins, stride, dmin, dstride, per = w.view().mins_args()
    d_bytes = d.stride(0) * d.element_size() if d is not None else 0
    return [mins, m.stride(0) * m.element_size(), stride, dmin, d_bytes, dstride, per]


def _group_by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) pairs `flat` [T * k] of expert ids -> (their order sorted by expert, stable
    so each expert's tokens stay in order; where each expert's group ends in that order [E]).

    Fixed shapes and no host read, so nothing waits for the GPU: torch.bincount on CUDA reads
    the ids' min and max back to size its output (two syncs per layer)."""
    sorted_ids, order = flat.sort(stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, experts, right=True)


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe's result by two grouped GEMMs (torch._grouped_mm: one kernel launch for all
    the experts, cuBLAS/CUTLASS grouped GEMM on CUDA) and no host sync: the per-expert row
    counts stay on the device as the groups' offsets. The path for GPUs; on the CPU torch runs
    it as a loop of matmuls, so there fused_moe (our kernels, chosen by measurement) is used."""
    k = ids.shape[1]
    order, ends = _group_by_expert(ids.reshape(-1), w13.shape[0])
    offs = ends.to(torch.int32)
    xs = x.index_select(0, order // k)
    # [E, N, K] weights as [E, K, N] views: column-major per expert, as the kernel wants.
    h = silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    return _combine(torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), weights, order, x.dtype)


def _combine(
    ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Expert outputs ys [T * k, H], in expert-sorted (token, slot) `order`, weighted by the
    router and summed back per token -> [T, H]. In fp32: one rounding at the end instead of
    one per expert."""
    t, k = weights.shape
    ys = ys.float() * weights.reshape(-1, 1)[order].float()
    unsorted = torch.empty_like(ys).index_copy_(0, order, ys)
    return unsorted.view(t, k, -1).sum(1).to(dtype)


def _expert(
    x: torch.Tensor, w13: Experts, w2: Experts, e: int, mm13: MatMul, mm2: MatMul
) -> torch.Tensor:
    """Expert e's SwiGLU MLP over the rows x [n, H] that chose it."""
    return mm2(silu_and_mul(mm13(x, w13[e])), w2[e])


class FusedMoE(nn.Module):
    """E SwiGLU experts with fused, tensor-parallel-sharded weights (see the module docstring).

    `load` takes the Hugging Face per-expert tensors (experts.{e}.gate_proj/up_proj/down_proj)
    and cuts this rank's slice out of each."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size ({tp_size})"
            )
        self.num_experts = num_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.inter = intermediate_size // tp_size
        i, h = self.inter, hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, h, i), requires_grad=False)
        self.mm13: MatMul = _matmul
        self.mm2: MatMul = _matmul
        # Up to how many tokens mm13 and mm2 are the GEMV (fused_moe's one call); None: the
        # default matmuls'.
        self.one_call_tokens: int | None = None
        # mm13's and mm2's picks per row count, where measured (decode_call's other GEMVs).
        self.names: RowNames | None = None
        self.grouped: bool | None = None  # grouped GEMM path; decided on the first forward

    def prepare_cpu_kernels(self, tuning: str = "cached") -> list[str]:
        """Measure (or read from the tuning cache) the fastest copy-free matmul per row count
        for this layer's expert shapes, as the dense layers do; the summary lines of the picks
        (none where nothing was measured: CPU kernels off, another device)."""
        if not _picks_wanted(tuning) or self._quantized():
            return []
        lines = []
        gemv_rows = cpu_kernels.MAX_ROWS  # as _matmul, where nothing was measured
        picked: list[list[str]] = []
        for name, w in (("mm13", self.w13), ("mm2", self.w2)):
            run, line, names = cpu_linear.row_runner(list(w.detach().unbind(0)), tuning)
            if run is not None:
                setattr(self, name, run)
                lines.append(line)
                gemv_rows = min(gemv_rows, _gemv_rows(names))
                picked.append(names)
        self.one_call_tokens = gemv_rows
        self.names = (picked[0], picked[1]) if len(picked) == 2 else None
        return lines

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self._quantized():  # quantized experts (minisgl/quant/), w13 or w2 or both
            w13, w2 = self.w13, self.w2
            mm13 = w13.expert_matmul if isinstance(w13, QuantWeight) else self.mm13
            mm2 = w2.expert_matmul if isinstance(w2, QuantWeight) else self.mm2
            y = fused_moe(x, w13, w2, weights, ids, mm13, mm2)
        else:
            if self.grouped is None:
                self.grouped = _grouped_gemm_works(x, self.w13)
            if self.grouped:
                y = grouped_moe(x, self.w13, self.w2, weights, ids)
            else:
                args = (self.mm13, self.mm2, self.one_call_tokens, self.names)
                y = fused_moe(x, self.w13, self.w2, weights, ids, *args)
        if self.tp_size > 1:
            distributed.all_reduce(y)
        return y

    def _quantized(self) -> bool:
        return isinstance(self.w13, QuantWeight) or isinstance(self.w2, QuantWeight)

    def weight_names(self) -> set[str]:
        return {
            f"{e}.{p}.weight"
            for e in range(self.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        }

    def load(self, name: str, t: torch.Tensor) -> bool:
        """`name` relative to `experts.` (e.g. "3.up_proj.weight"); False if not ours."""
        e_str, _, proj = name.partition(".")
        if not e_str.isdigit() or int(e_str) >= self.num_experts:
            return False
        e, i, r = int(e_str), self.inter, self.tp_rank
        if proj == "gate_proj.weight":
            self.w13.data[e, :i].copy_(t.narrow(0, r * i, i))
        elif proj == "up_proj.weight":
            self.w13.data[e, i:].copy_(t.narrow(0, r * i, i))
        elif proj == "down_proj.weight":
            self.w2.data[e].copy_(t.narrow(1, r * i, i))
        else:
            return False
        return True


def _picks_wanted(tuning: str) -> bool:
    """Whether a mixture's float matmuls get picks (cpu_linear.row_runner): where tuning is on,
    or a pick is forced for every layer (MINISGL_CPU_LINEAR, as the dense layers take it)."""
    return tuning != "off" or bool(os.environ.get("MINISGL_CPU_LINEAR"))


def prepare_routers(blocks: list[SparseMoeBlock], tuning: str) -> list[str]:
    """Every sparse layer's router (one shape) gets the copy-free matmul measured fastest per
    row count, timed once over all of them, as the experts are (cpu_linear.row_runner): a
    decode step reads each router cold (on a 2-core Zen 4, 128x2048 bf16 at one row: the
    AVX-512 GEMV 18.7 us a call against the GEMV's 27.2, at 8 rows 28 against 75). The
    summary line of the picks, or none."""
    if not blocks or not _picks_wanted(tuning):
        return []
    run, line, names = cpu_linear.row_runner([b.gate.detach() for b in blocks], tuning)
    if run is None:
        return []
    for b in blocks:
        b.route_mm, b.route_names = run, names
    return [line]


class SparseMoeBlock(nn.Module):
    """Router + experts: Qwen3-MoE's `mlp` of a sparse layer (HF names: mlp.gate, mlp.experts)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        # The router is small ([E, H]) and every rank needs all of its logits: replicated.
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)
        # The router's matmul (prepare_routers: measured, as the experts'), and its pick per
        # row count; untuned: the GEMV on CPU (torch's small-M matmul took ~1 ms for this
        # 0.5 MB router).
        self.route_mm: MatMul = _matmul
        self.route_names: list[str] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers casts the routing weights to the activations' dtype before mixing.
        logits = self.route_mm(x, self.gate)
        weights, ids = route(logits, self.top_k, self.renormalize, x.dtype)
        return self.experts(x, weights, ids)

    def route_pick(self, rows: int) -> str:
        """The router's matmul at `rows` rows: its measured pick, or the untuned policy's."""
        if self.route_names is not None:
            return self.route_names[rows]
        return "gemv" if rows <= cpu_kernels.MAX_ROWS and cpu_kernels.supports(self.gate) else ""

    def weight_names(self) -> set[str]:
        return {"gate.weight"} | {"experts." + n for n in self.experts.weight_names()}

    def load(self, name: str, t: torch.Tensor) -> bool:
        """`name` relative to the layer's `mlp.`; False for a name that is not ours."""
        if name == "gate.weight":
            self.gate.data.copy_(t)
            return True
        if name.startswith("experts."):
            return self.experts.load(name[len("experts.") :], t)
        return False
