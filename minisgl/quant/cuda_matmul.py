"""Quantized weights on a GPU, set up once after loading: each QuantWeight's buffers are
replaced by the operands of a torch kernel that multiplies them as they are, or, where no such
kernel fits, by the weight dequantized to the model's dtype (said in one log line).

- fp8 (e4m3 codes) on GPUs with FP8 tensor cores (compute capability 8.9+): the codes as they
  are, through `torch.nn.functional.scaled_mm`. Block scales (128x128 weight blocks) run as
  BlockWise128x128 against the activations quantized per token and group of 128 inputs
  (BlockWise1x128); per-channel and per-tensor scales as RowWise against per-token scales.
  Whether this torch and GPU take a recipe is probed once per shape at set-up, not assumed.
- 4-bit integer codes (AWQ, GPTQ-Int4 without desc_act, --quantization int4) with groups of
  32, 64, 128 or 256: torch's int4 weight-only matmul (`aten._weight_int4pack_mm`, bf16
  activations), the codes repacked at load by `aten._convert_weight_to_int4pack`; its scale and
  zero per group are bf16 and it computes (q - 8) * scale + zero, so our zero point z becomes
  (8 - z) * scale (less the group's min where it has one: GGUF's Q4_K).
- everything else (8-bit integer codes, GPTQ desc_act, fp8 below 8.9 or where the probe
  fails): dequantized at load, then plain matmuls.

A tied LM head (--lm-head-quantization) is also the embedding table, looked up by token id:
its rows stay readable after the conversion (`QuantWeight.lookup`): from the dense weight where
it was dequantized, from the fp8 codes (shared) and their per-row scales, and for int4 from the
codes as loaded, kept beside the repacked ones (the repacked layout has no row to gather).

The choice and the conversions are plain functions over tensors, so they run (and are tested)
on the CPU too: `Int4Ops` names the torch ops, the CUDA ones or their CPU twins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.quant.qtensor import FP8, QTensor, dequantize, take_rows, unpack_nibbles
from minisgl.quant.weight import QuantWeight, multiplied_weights

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm takes
FP8_CAPABILITY = (8, 9)
FP8_SCALED_MM_BLOCK = 128  # BlockWise1x128 activations x BlockWise128x128 weights
Kernel = Callable[[torch.Tensor, QTensor], torch.Tensor]


@dataclass(frozen=True)
class Int4Ops:
    """The int4 weight-only matmul's torch ops and the code layout its packer takes."""

    convert: Callable[[torch.Tensor, int], torch.Tensor]
    mm: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
    packer_input: Callable[[torch.Tensor], torch.Tensor]  # our [N, K/2] codes -> its input


def cuda_codes(codes: torch.Tensor) -> torch.Tensor:
    """Our [N, K/2] nibbles (input feature 2j low) -> the CUDA packer's uint8 [N, K/2], input
    feature 2j in the high nibble."""
    return ((codes & 15) << 4) | (codes >> 4)


def cpu_codes(codes: torch.Tensor) -> torch.Tensor:
    """Our [N, K/2] nibbles -> the CPU packer's int32 [N, K], one code per element."""
    return unpack_nibbles(codes).to(torch.int32)


CUDA_INT4 = Int4Ops(
    torch.ops.aten._convert_weight_to_int4pack,
    torch.ops.aten._weight_int4pack_mm,
    cuda_codes,
)
CPU_INT4 = Int4Ops(
    torch.ops.aten._convert_weight_to_int4pack_for_cpu,
    torch.ops.aten._weight_int4pack_mm_for_cpu,
    cpu_codes,
)


def choose(w: QuantWeight, capability: tuple[int, int]) -> tuple[str, str]:
    """(path, why) for a weight on a GPU of `capability`: "fp8", "int4" or "dequantize"."""
    fp8 = w.codes.dtype == FP8
    if fp8:
        if capability < FP8_CAPABILITY:
            return "dequantize", f"fp8 needs compute capability 8.9+, this GPU is {capability}"
        if w.group_size not in (0, FP8_SCALED_MM_BLOCK):
            # A tensor-parallel cut inside a 128-block leaves narrower blocks (attach.py);
            # scaled_mm's block recipe is 128x128 only.
            return "dequantize", f"fp8 blocks of {w.group_size} inputs (scaled_mm takes 128)"
        return "fp8", "scaled_mm"
    if w.g_idx is not None:
        return "dequantize", "desc_act's scattered groups"
    if w.bits != 4:
        return "dequantize", f"no {w.bits}-bit weight-only matmul in torch on CUDA"
    n, k = w.codes.shape[-2], w.in_features
    if w.group_size not in INT4_GROUPS or k % w.group_size:
        return "dequantize", f"int4 group {w.group_size or 'per channel'} (torch takes 32-256)"
    if n % 8 or k % 32:
        return "dequantize", f"a {n}x{k} weight (int4 matmul needs N % 8 == 0, K % 32 == 0)"
    return "int4", "_weight_int4pack_mm"


def inner_k_tiles(k: int) -> int:
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def int4_scales_and_zeros(w: QTensor) -> torch.Tensor:
    """[N, G] scales and zero points -> the int4 matmul's [G, N, 2] bf16 (scale, zero) with
    weight = (q - 8) * scale + zero, i.e. zero = (8 - z) * scale for our (q - z) * scale."""
    assert w.zeros is not None
    scales = w.scales.float()
    zeros = (8.0 - w.zeros.float()) * scales
    mins = w.float_mins()
    if mins is not None:
        zeros -= mins
    return torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4_operands(w: QTensor, ops: Int4Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales and zeros) of one [N, K] weight for ops.mm."""
    packed = ops.convert(ops.packer_input(w.codes), inner_k_tiles(w.in_features))
    return packed, int4_scales_and_zeros(w)


def int4_kernel(ops: Int4Ops) -> Kernel:
    def run(x: torch.Tensor, w: QTensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = ops.mm(xb, w.codes, w.group_size, w.scales)
        return y.to(x.dtype).reshape(*lead, y.shape[-1])

    return run


def fp8_block_scales(rows: torch.Tensor, block: int, pad_to: int = 4) -> torch.Tensor:
    """Our per-row block scales [..., N, K/b] (each block's scale repeated over its b rows;
    experts first) -> the [..., ceil(N/b), K/b padded to a multiple of `pad_to`] block scales
    scaled_mm takes (zeros in the padding): on an H200 it refused K/b = 1 or 2 unpadded
    ("scale_b must have shape 4 x 1"), as a Qwen3-30B-A3B expert's 768 inputs (6 blocks) are."""
    per_block = rows[..., ::block, :]
    *lead, nb, kb = per_block.shape
    padded = torch.zeros(
        *lead, nb, -(-kb // pad_to) * pad_to, dtype=torch.float32, device=rows.device
    )
    padded[..., :kb] = per_block
    return padded


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 codes [M4, K], float32 scales [M4, K/group] stored column-major), M4
    being M rounded up to a multiple of 4 (rows of zeros): one scale per token and group of
    `group` inputs (group = K: per token)."""
    m, k = x.shape
    pad = -m % 4
    xf = F.pad(x.float(), (0, 0, 0, pad)) if pad else x.float()
    groups = xf.view(m + pad, k // group, group)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    codes = (groups / scale.unsqueeze(-1)).to(FP8).view(m + pad, k)
    return codes, scale.t().contiguous().t()


def fp8_kernel(block: int) -> Kernel:
    """x @ w.T for fp8 codes: w.scales holds scaled_mm's weight scales (block: from
    fp8_block_scales; else [1, N] per output row)."""
    recipes = F.ScalingType  # type: ignore[attr-defined]

    def run(x: torch.Tensor, w: QTensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        codes, a_scale = quantize_activations(x2, block or k)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if block:
            y = F.scaled_mm(  # type: ignore[attr-defined]
                codes, w.codes.t(), a_scale, recipes.BlockWise1x128,
                w.scales.t(), recipes.BlockWise128x128, output_dtype=out_dtype,
            )  # fmt: skip
        else:
            y = F.scaled_mm(  # type: ignore[attr-defined]
                codes, w.codes.t(), a_scale.contiguous(), recipes.RowWise,
                w.scales, recipes.RowWise, output_dtype=out_dtype,
            )  # fmt: skip
        return y[: x2.shape[0]].to(x.dtype).reshape(*lead, -1)

    return run


def _per_expert(w: QuantWeight, fn: Callable[[QTensor], tuple[torch.Tensor, ...]]) -> list:
    views = [w.view(e) for e in range(w.experts)] if w.experts else [w.view()]
    parts = [fn(v) for v in views]
    return [torch.stack(p) if w.experts else p[0] for p in zip(*parts, strict=True)]


def _replace(w: QuantWeight, codes: torch.Tensor, scales: torch.Tensor, kernel: Kernel) -> None:
    # The mins are in the new operands (the int4 zeros, the dense weight) or none (fp8).
    w.codes, w.scales, w.zeros, w.g_idx, w.mins = codes, scales, None, None, None
    w.mins_scales = None
    w.kernel = kernel


def _fp8_row_scales(v: QTensor) -> tuple[torch.Tensor]:
    return (v.scales.reshape(1, -1).float().contiguous(),)


def to_int4(w: QuantWeight, ops: Int4Ops) -> None:
    codes, scales = _per_expert(w, lambda v: int4_operands(v, ops))
    _replace(w, codes, scales, int4_kernel(ops))


def to_fp8(w: QuantWeight) -> None:
    block = w.group_size
    # Block scales of all the experts at once: stacking each one's would drop their padding.
    scales = fp8_block_scales(w.scales, block) if block else _per_expert(w, _fp8_row_scales)[0]
    _replace(w, w.codes, scales, fp8_kernel(block))


def to_dense(w: QuantWeight, dtype: torch.dtype) -> None:
    (weight,) = _per_expert(w, lambda v: (dequantize(v, dtype),))
    # No scales, but one empty row of them per expert: an expert's view indexes them.
    scales = weight.new_empty(*weight.shape[:-2], 0)
    _replace(w, weight, scales, lambda x, v: F.linear(x, v.codes.to(x.dtype)))


def _lookup(w: QuantWeight, path: str, loaded: QTensor) -> None:
    """Rows of a looked-up table (a tied LM head) after `path` converted it; `loaded`: its
    buffers as they were loaded."""
    if path == "dequantize":
        dense = w.codes
        w.lookup = lambda ids, dtype: F.embedding(ids, dense).to(dtype)
        return
    k = w.in_features
    w.lookup = lambda ids, dtype: dequantize(take_rows(loaded, ids), dtype).view(*ids.shape, k)


def _fp8_works(w: QuantWeight, dtype: torch.dtype) -> str | None:
    """Runs the fp8 kernel once on 4 rows of zeros; None if it works, else why not."""
    probe = QuantWeight(
        w.codes.shape[-2], w.in_features, bits=8, fp8=True, group_size=w.group_size,
        groups=w.scales.shape[-1], scattered_groups=False,
    ).to(w.codes.device)  # fmt: skip
    probe.codes.zero_()
    probe.scales.fill_(1.0)
    try:
        to_fp8(probe)
        probe.kernel(torch.zeros(4, w.in_features, dtype=dtype, device=w.codes.device),
                     probe.view())  # type: ignore[misc]  # fmt: skip
    except AttributeError:  # a torch before F.scaled_mm and its ScalingType recipes (2.10)
        return f"this torch ({torch.__version__}) has no torch.nn.functional.scaled_mm"
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return f"scaled_mm refused this fp8 layout here ({str(e).splitlines()[0][:120]})"
    return None


def prepare(
    model: nn.Module,
    dtype: torch.dtype,
    capability: tuple[int, int],
    ops: Int4Ops = CUDA_INT4,
    probe: bool = True,
) -> str | None:
    """Converts every QuantWeight of `model` for the GPU; returns the log line (None: no
    quantized weights). `probe` runs each fp8 shape once before trusting scaled_mm with it."""
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    probed: dict[tuple[int, int, int], str | None] = {}
    # (an untied table only looked up: its rows dequantize from the buffers as stored)
    for m in multiplied_weights(model):
        path, why = choose(m, capability)
        if path == "fp8" and probe:
            key = (m.codes.shape[-2], m.in_features, m.group_size)
            if key not in probed:
                probed[key] = _fp8_works(m, dtype)
            if probed[key] is not None:
                path, why = "dequantize", str(probed[key])
        loaded = m.view() if m.looked_up and not m.experts else None
        if path == "int4":
            to_int4(m, ops)
        elif path == "fp8":
            to_fp8(m)
        else:
            to_dense(m, dtype)
            reasons[why] = reasons.get(why, 0) + 1
        if loaded is not None:
            _lookup(m, path, loaded)
        counts[path] = counts.get(path, 0) + 1
    if not counts:
        return None
    names = {"fp8": "fp8 scaled_mm", "int4": "int4 weight-only matmul", "dequantize": "dequantized"}
    done = ", ".join(f"{n} {names[p]}" for p, n in counts.items())
    line = f"quantized weights on the GPU: {done}"
    if reasons:
        line += f"; dequantized to {str(dtype).removeprefix('torch.')} at load: " + "; ".join(
            f"{n} for {why}" for why, n in reasons.items()
        )
    return line
