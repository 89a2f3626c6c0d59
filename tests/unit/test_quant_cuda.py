"""Quantized weights on a GPU (minisgl/quant/cuda_matmul.py). The host side runs here on the
CPU: which path each format takes and why, the int4 repacking and scale/zero conversion through
torch's CPU twin of the int4 weight-only matmul, the fp8 operands (block scales in scaled_mm's
layout, per-token-group activation scales) checked against the blockwise product they encode,
the per-channel fp8 path through torch's CPU scaled_mm, and the dequantize-at-load fallback.
The same kernels on a GPU are checked where one is present."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minisgl.quant import cuda_matmul as cm
from minisgl.quant.qtensor import FP8, QTensor, dequantize, unpack_nibbles
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import head_scheme, load_scheme
from minisgl.quant.weight import QuantWeight


def _holder(w: QTensor, experts: int = 0) -> QuantWeight:
    """A QuantWeight filled with `w` (every expert the same weight scaled by e + 1)."""
    n, k = w.shape
    h = QuantWeight(
        n, k, bits=w.bits, fp8=w.codes.dtype == FP8, group_size=w.group_size,
        groups=w.scales.shape[1], scattered_groups=w.g_idx is not None, experts=experts,
    )  # fmt: skip
    for e in range(max(experts, 1)):
        view = h.view(e) if experts else h.view()
        view.copy_(QTensor(w.codes, w.scales * (e + 1), w.zeros, w.g_idx, w.bits,
                           w.group_size, k))  # fmt: skip
    return h


def _weight(n: int = 256, k: int = 384, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (y.float() - ref.float()).norm() / ref.float().norm()
    assert err < tol, f"relative error {err:.4f}"


def test_each_format_takes_a_torch_kernel_or_says_why_not() -> None:
    int4 = _holder(quantize(_weight(), load_scheme("int4")))
    fp8 = _holder(quantize(_weight(), load_scheme("fp8")))
    int8 = _holder(quantize(_weight(), load_scheme("int8")))
    assert cm.choose(int4, (8, 0)) == ("int4", "_weight_int4pack_mm")
    assert cm.choose(fp8, (9, 0)) == ("fp8", "scaled_mm")
    assert cm.choose(fp8, (8, 6))[0] == "dequantize"
    assert "8.9" in cm.choose(fp8, (8, 6))[1]
    assert cm.choose(int8, (9, 0)) == ("dequantize", "no 8-bit weight-only matmul in torch on CUDA")
    per_channel = QTensor(int4.codes, int4.scales[:, :1], int4.zeros[:, :1], None, 4, 0, 384)
    assert cm.choose(_holder(per_channel), (9, 0))[0] == "dequantize"


def test_fp8_blocks_a_tensor_parallel_cut_narrowed_are_dequantized_not_misread() -> None:
    """--tp-size 2 over 384 inputs leaves each rank 192 in fp8 blocks of 64 (attach.py):
    scaled_mm's 128x128 block recipe would read their scales as the wrong blocks."""
    fp8 = quantize(_weight(), load_scheme("fp8")).narrow(1, 192, 192)
    assert fp8.group_size == 64
    path, why = cm.choose(_holder(fp8), (9, 0))
    assert path == "dequantize" and "blocks of 64" in why


def test_cuda_packer_input_has_the_even_input_feature_in_the_high_nibble() -> None:
    w = quantize(_weight(), load_scheme("int4"))
    packed = cm.cuda_codes(w.codes)
    high_first = torch.stack((packed >> 4, packed & 15), dim=-1).flatten(-2)
    assert torch.equal(high_first, unpack_nibbles(w.codes))


@pytest.mark.parametrize("experts", [0, 3])
def test_int4_repacked_for_the_int4_matmul_equals_the_dequantized_weight(experts: int) -> None:
    """Through torch's CPU int4pack ops, which take the same scales-and-zeros tensor as the
    CUDA ones: (q - 8) * scale + zero with zero = (8 - z) * scale, in bf16."""
    w = quantize(_weight(), load_scheme("int4"))
    h = _holder(w, experts)
    refs = [dequantize(h.view(e) if experts else h.view(), torch.float32)
            for e in range(max(experts, 1))]  # fmt: skip
    cm.to_int4(h, cm.CPU_INT4)
    assert h.zeros is None and h.scales.dtype == torch.bfloat16
    assert h.shape == ((experts,) if experts else ()) + (256, 384)
    x = torch.randn(5, 384)
    for e, ref in enumerate(refs):
        y = h.kernel(x, h.view(e) if experts else h.view())  # type: ignore[misc]
        assert y.dtype == x.dtype and y.shape == (5, 256)
        _close(y, x @ ref.t(), 0.02)  # bf16 activations, scales and zeros


def test_fp8_block_operands_encode_the_weight_and_the_activations() -> None:
    w = quantize(_weight(n=320, k=640), load_scheme("fp8"))  # 3 x 5 blocks, the last rows part
    padded = cm.fp8_block_scales(w.scales, 128)
    assert padded.shape == (3, 8) and not padded[:, 5:].any()  # K blocks padded to 4s
    s = padded[:, :5]
    assert torch.equal(s.repeat_interleave(128, 0)[:320], w.scales)
    x = torch.randn(6, 640)
    codes, a_scale = cm.quantize_activations(x, 128)
    assert codes.shape == (8, 640) and a_scale.shape == (8, 5) and a_scale.stride() == (1, 8)
    assert codes[6:].float().abs().sum() == 0  # the padding rows
    x_back = codes.float() * a_scale.repeat_interleave(128, 1)
    _close(x_back[:6], x, 0.05)
    # What scaled_mm computes with BlockWise1x128 x BlockWise128x128 from these operands.
    w_back = w.codes.float() * s.repeat_interleave(128, 0)[:320].repeat_interleave(128, 1)
    _close((x_back @ w_back.t())[:6], x @ dequantize(w, torch.float32).t(), 0.06)


def test_each_experts_fp8_block_scales_keep_the_padded_rows_scaled_mm_takes() -> None:
    # A Qwen3-MoE FP8 checkpoint on a GPU: each expert's [e] view of the converted scales is
    # what scaled_mm reads, so it must be a dense layer's (K blocks padded to a multiple of 4).
    w = quantize(_weight(n=320, k=640), load_scheme("fp8"))
    h = _holder(w, experts=3)
    per_row = [h.view(e).scales.clone() for e in range(3)]
    cm.to_fp8(h)
    for e in range(3):
        s = h.view(e).scales
        assert s.shape == (3, 8) and s.is_contiguous() and not s[:, 5:].any()
        assert torch.equal(s[:, :5].repeat_interleave(128, 0)[:320], per_row[e])


def test_fp8_per_channel_runs_through_scaled_mm_rowwise() -> None:
    codes = (_weight() / 0.05 * 40).to(FP8)
    scales = torch.rand(256, 1) * 0.01 + 0.001
    h = _holder(QTensor(codes, scales, None, None, 8, 0, 384))
    ref = dequantize(h.view(), torch.float32)
    cm.to_fp8(h)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    y = h.kernel(x, h.view())  # type: ignore[misc]  # torch's CPU scaled_mm takes RowWise
    assert y.shape == (3, 256) and y.dtype == torch.bfloat16
    _close(y, x.float() @ ref.t(), 0.06)


def test_prepare_converts_every_weight_and_says_what_was_dequantized() -> None:
    model = nn.ModuleDict(
        {
            "a": _holder(quantize(_weight(), load_scheme("int4"))),
            "b": _holder(quantize(_weight(), load_scheme("int8"))),
            "c": _holder(quantize(_weight(), load_scheme("fp8"))),
        }
    )
    dense_ref = dequantize(model["b"].view(), torch.bfloat16)
    line = cm.prepare(model, torch.bfloat16, (8, 6), ops=cm.CPU_INT4, probe=False)
    assert line == (
        "quantized weights on the GPU: 1 int4 weight-only matmul, 2 dequantized; "
        "dequantized to bfloat16 at load: 1 for no 8-bit weight-only matmul in torch on CUDA; "
        "1 for fp8 needs compute capability 8.9+, this GPU is (8, 6)"
    )
    b = model["b"]
    assert torch.equal(b.codes, dense_ref)
    x = torch.randn(2, 384, dtype=torch.bfloat16)
    assert torch.equal(b.kernel(x, b.view()), F.linear(x, dense_ref))  # type: ignore[misc]
    assert cm.prepare(nn.Linear(2, 2), torch.bfloat16, (9, 0)) is None


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantized_experts_are_still_read_one_expert_at_a_time(fmt: str) -> None:
    # A Qwen3-MoE whose experts take no GPU kernel (8-bit codes; fp8 where scaled_mm is
    # refused): the fused MoE reads each expert's view of the dequantized weights.
    h = _holder(quantize(_weight(), load_scheme(fmt)), experts=3)
    dense = [dequantize(h.view(e), torch.bfloat16) for e in range(3)]
    line = cm.prepare(nn.ModuleDict({"experts": h}), torch.bfloat16, (8, 6), probe=False)
    assert line is not None and line.startswith("quantized weights on the GPU: 1 dequantized")
    x = torch.randn(4, 384, dtype=torch.bfloat16)
    for e in range(3):
        assert torch.equal(h.kernel(x, h[e]), F.linear(x, dense[e]))  # type: ignore[misc]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_on_the_gpu_the_kernels_equal_the_dequantized_weight(fmt: str) -> None:
    if fmt == "fp8" and torch.cuda.get_device_capability() < cm.FP8_CAPABILITY:
        pytest.skip("fp8 needs compute capability 8.9+")
    w = quantize(_weight(n=512, k=1024), load_scheme(fmt))
    h = _holder(w).cuda()
    ref = dequantize(h.view(), torch.float32)
    line = cm.prepare(nn.ModuleDict({"w": h}), torch.bfloat16, torch.cuda.get_device_capability())
    assert line is not None and "dequantized" not in line, line
    x = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16)
    _close(h.kernel(x, h.view()), x.float() @ ref.t(), 0.06)  # type: ignore[misc]


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_tied_head_is_still_looked_up_by_row_after_the_gpu_conversion(fmt: str) -> None:
    # The LM head's schemes (--lm-head-quantization), each taking its GPU path (int8 is
    # dequantized, int4 repacked, fp8 per-row scales for scaled_mm) while the tied embedding
    # keeps reading rows of the same weight.
    w = quantize(_weight(n=320, k=256), head_scheme(fmt))
    h = _holder(w)
    h.looked_up = True
    ref = dequantize(h.view(), torch.float32)
    cm.prepare(nn.ModuleDict({"head": h}), torch.bfloat16, (9, 0), ops=cm.CPU_INT4, probe=False)
    ids = torch.tensor([[3, 0], [319, 3]])
    assert torch.equal(h.rows(ids, torch.bfloat16), ref.to(torch.bfloat16)[ids])


def test_an_untied_table_only_looked_up_is_left_as_stored() -> None:
    # An untied embedding table held quantized (a GGUF file's token_embd) is never multiplied:
    # the GPU conversion leaves its buffers, and names it nowhere, while its rows read as before.
    w = quantize(_weight(n=320, k=256), load_scheme("int4"))
    h = _holder(w)
    h.looked_up, h.multiplied = True, False
    codes, ref = h.codes, dequantize(h.view(), torch.float32)
    assert cm.prepare(nn.ModuleDict({"t": h}), torch.bfloat16, (9, 0), ops=cm.CPU_INT4) is None
    assert h.codes is codes and h.kernel is None
    ids = torch.tensor([[3, 0], [319, 3]])
    assert torch.equal(h.rows(ids, torch.bfloat16), ref.to(torch.bfloat16)[ids])


def test_a_torch_without_scaled_mm_dequantizes_fp8_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch < 2.10 (the package allows 2.5+) has no F.scaled_mm nor its ScalingType recipes:
    # the load carries on with the weight dequantized, instead of stopping at an AttributeError.
    monkeypatch.delattr(F, "ScalingType", raising=False)
    monkeypatch.delattr(F, "scaled_mm", raising=False)
    h = _holder(quantize(_weight(), load_scheme("fp8")))
    dense = dequantize(h.view(), torch.bfloat16)
    line = cm.prepare(nn.ModuleDict({"w": h}), torch.bfloat16, (9, 0), ops=cm.CPU_INT4)
    assert line is not None and "has no torch.nn.functional.scaled_mm" in line, line
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    assert torch.equal(h.kernel(x, h.view()), F.linear(x, dense))  # type: ignore[misc]
