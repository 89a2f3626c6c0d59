"""Many rows (prefill, large decode batches) over a quantized weight on the CPU, by
layers/csrc/qdequant.c: each thread dequantizes 16 weight rows at a time, a segment of K at a
time, into fp32 laid out for a 6x16 register tile, once for every input row, and multiplies
there. The values are qtensor.dequantize's exactly, the products and sums fp32 (as the bf16
panel kernel's), so the result is the dequantized weight's matmul to fp32 rounding; weights as
cpu_gemv.usable takes them. `int16_panel`: the same blocking with x quantized per row to int16
and integer codes multiplied in int32 (VPMADDWD), where that is faster. `amx_panel`: on AMX
tiles, or VDPBF16PS where the CPU has AVX512-BF16 and no AMX, the panel dequantized once into
bf16 (qamx.c). `amx_int`: few rows (decode) straight from the codes on AMX tiles: integer
codes on AMX-INT8 (qamxi.c), x quantized per row to int16 as the decode GEMV does; fp8 codes
converted exactly to bf16 on AMX-BF16 (qamxf.c), bf16 x. `x8_panel`: many rows of x rounded to
8 bits per row and block of features against integer codes with AVX512-VNNI (qvnni.c;
--cpu-quantized-activations int8 only). Candidates of the quantized chooser (cpu_choice.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv
from minisgl.quant.qtensor import QTensor, without_mins

# Rows of x from which the picks that dequantize panels into bf16 (amx_panel, amx_bf16_vpanel)
# take a weight's group mins into the panel's values (mins_folded) instead of
# qmins.c's term after the matmul (M x N x groups multiply-adds: ~375 ms of the 641 a Q4_1
# file's 1024-token prefill lost to bf16 on a Zen 4): past the decode chain's steps
# (layers/cpu_chain.MAX_ROWS rows), whose bits the layer path keeps by the same kernels and
# term.
FOLD_MINS_ROWS = 65


def dequant_panel(
    x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's dtype), any M."""
    lib = cpu_kernels.load()
    assert lib is not None
    return run_c(lib.qpanel[cpu_gemv.kind(w)], x, w, out_dtype)


def int16_panel(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As dequant_panel, integer codes multiplied by x quantized per row to int16 (as the decode
    GEMV does) with VPMADDWD, whose multiply-adds issue on more of an AVX2 core's pipes than
    fp32 FMAs. fp8 codes, which have no integer form, take dequant_panel."""
    lib = cpu_kernels.load()
    assert lib is not None
    kind = cpu_gemv.kind(w)
    fn = lib.qpanel16.get(kind) or lib.qpanel[kind]
    return run_c(fn, x, w, out_dtype)


def amx_panel(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As dequant_panel on bf16 dot products (qamx.c): a panel of weight rows dequantized once
    into bf16 (the dequantized weight rounded to bf16, as a bf16 twin of the model holds it)
    and multiplied with bf16 activations by TDPBF16PS on AMX tiles, or, on a CPU with
    AVX512-BF16 and no AMX (AMD Zen 4), by VDPBF16PS on zmm registers (1.0-1.1x the time of
    oneDNN's bf16 matmul over the bf16 weight at 320-512 rows on a Zen 4 EPYC, one thread,
    where the fp32 panel took 2.1-2.5x); fp32 sums either way. fp32 activations (which bf16
    would round) and CPUs or builds with neither take dequant_panel."""
    lib = cpu_kernels.load()
    assert lib is not None
    kind = cpu_gemv.kind(w)
    fn = lib.qamx.get(kind)
    if fn is None or x.dtype != torch.bfloat16:
        fn = lib.qpanel[kind]
    return run_c(fn, x, w, out_dtype)


def amx_int(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Few rows on AMX tiles straight from the codes, each weight byte costing the same work
    for 1 to 16 input rows: integer codes (8 or 4 bits) as AMX-INT8 tiles against x quantized
    per row to int16 (qgemv's numerics) split into a signed high and an unsigned low byte
    (qamxi.c); fp8 e4m3 codes converted exactly to bf16 a tile step at a time against bf16 x,
    each group's fp32 sum times its scale (qamxf.c). fp8 with fp32 x (which bf16 would round)
    and CPUs or builds without the tiles take the decode GEMV (qgemv)."""
    lib = cpu_kernels.load()
    assert lib is not None
    kind = cpu_gemv.kind(w)
    fn = lib.qamxi.get(kind)
    if fn is None or (kind == "fp8" and x.dtype != torch.bfloat16):
        return cpu_gemv.qgemv(x, w, out_dtype)
    return run_c(fn, x, w, out_dtype)


def x8_takes(w: QTensor) -> bool:
    """Whether x8_panel's kernel (qvnni.c, AVX512-VNNI builds) takes w: 8- or 4-bit integer
    codes in contiguous groups of a multiple of 32 features, K a multiple of 64."""
    lib = cpu_kernels.load()
    if lib is None or lib.qvnni_takes is None or w.g_idx is not None:
        return False
    kind = cpu_gemv.kind(w)
    k = w.in_features
    return kind in lib.qvnni and bool(lib.qvnni_takes(w.bits, k, w.group_size or k))


def x8_panel(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Many rows of x rounded to 8 bits against integer codes with VPDPBUSD (qvnni.c): x
    quantized per row and block of (at most) 128 features with its own scale, a panel of 48
    weight rows repacked once per call, exact integer sums folded per block. Not exact: the
    --cpu-quantized-activations int8 kernel for prefill and big batches (the chooser offers it
    only in that mode). Weights it does not take (x8_takes) run amx_panel, exactly."""
    lib = cpu_kernels.load()
    if lib is None or not x8_takes(w):
        return amx_panel(x, w, out_dtype)
    return run_c(lib.qvnni[cpu_gemv.kind(w)], x, w, out_dtype)


def run_mins(
    pick: str | None,
    run: Callable[[torch.Tensor, QTensor, torch.dtype], torch.Tensor],
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x @ W.T for a weight with group mins, as a layer runs it for the kernel choice's `pick`
    at x's rows (None: a kernel outside the choice): from FOLD_MINS_ROWS rows on a pick that
    folds them into its panel, that (mins_folded); else `run(x, bare, dtype)`, x times the
    weight without its mins in `dtype`, less their term (minus_mins)."""
    if pick is not None and x.shape[0] >= FOLD_MINS_ROWS:
        folded = mins_folded(pick, x, w, out_dtype)
        if folded is not None:
            return folded
    bare = without_mins(w)
    return minus_mins(lambda x, dtype: run(x, bare, dtype), x, w, out_dtype)


def mins_folded(
    pick: str, x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None
) -> torch.Tensor | None:
    """x @ W.T for a weight with group mins by `pick`'s panel kernel with the mins folded into
    its bf16 panel (qamx.c's *_mins: the values of the weight dequantized with its mins,
    rounded to bf16), where `pick` is amx_panel (row-major codes) or amx_bf16_vpanel (packed)
    and this build has it for bf16 x; else None."""
    lib = cpu_kernels.load()
    if lib is None or x.dtype != torch.bfloat16 or w.mins is None or w.g_idx is not None:
        return None
    if pick == "amx_panel" and not cpu_gemv.usable(x, w):  # row-major: groups of 32n
        return None
    table = {"amx_panel": lib.qamx_mins, "amx_bf16_vpanel": lib.qamx_mins_packed}.get(pick)
    fn = table.get(cpu_gemv.kind(w)) if table is not None else None
    if fn is None:
        return None
    return run_c(fn, x, w, out_dtype, w.mins_args())


def minus_mins(
    run: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """x @ W.T for a weight with group mins (weight = (code - zero) * scale - min), where
    `run(x, dtype)` multiplies by the rest in `dtype` on the CPU: that in float32, less each
    group's min times the sum of x over the group, rounded once to `out_dtype` (default x's),
    by csrc/qmins.c (the decode chain's call: the same bits)."""
    lib = cpu_kernels.load()
    assert lib is not None and w.mins is not None and w.g_idx is None and x.dim() == 2
    x = x.contiguous()
    acc = run(x, torch.float32)
    dtype = out_dtype or x.dtype
    y = acc if dtype == torch.float32 else torch.empty_like(acc, dtype=dtype)
    n, k = acc.shape[1], w.in_features
    done = lib.qmins(
        x.data_ptr(), int(x.dtype == torch.bfloat16), acc.data_ptr(), *w.mins_args(),
        y.data_ptr(), int(dtype == torch.bfloat16), x.shape[0], n, k, w.group_size or k,
    )  # fmt: skip
    if not done:
        raise MemoryError(f"no memory for the group sums of {x.shape[0]} rows of x (qmins)")
    return y


def run_c(
    fn,  # noqa: ANN001
    x: torch.Tensor,
    w: QTensor,
    out_dtype: torch.dtype | None,
    extra: tuple[int, ...] = (),
) -> torch.Tensor:
    """fn, a C kernel taking qgemv's arguments (`extra` ones after the weight's: qamx's
    mins), over x and w's operands: y [M, N] in `out_dtype` (default x's), written by the
    kernel (fp32 or bf16) and converted otherwise."""
    ops = cpu_gemv.operands(w)  # the weight's arguments, built once (as qgemv's)
    out_dtype = out_dtype or x.dtype
    x_bf16 = x.dtype == torch.bfloat16
    xc = x.contiguous() if x_bf16 or x.dtype == torch.float32 else x.float().contiguous()
    m, k = xc.shape
    if k != ops.k:  # the kernel would read past x's rows
        raise ValueError(f"x {tuple(x.shape)} @ a quantized weight of K = {ops.k}")
    y_bf16 = out_dtype == torch.bfloat16
    y = torch.empty(m, ops.n, dtype=torch.bfloat16 if y_bf16 else torch.float32)
    if m:  # the AMX kernels fault on tiles of 0 rows (an LM head call with no row to sample)
        fn(xc.data_ptr(), x_bf16, *ops.args, *extra, y.data_ptr(), y_bf16, m, *ops.sizes)
    return y if y.dtype == out_dtype else y.to(out_dtype)
