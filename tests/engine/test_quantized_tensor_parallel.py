"""Quantized checkpoints under TP=2 generate exactly the tokens of their dequantized weights:
each rank cuts its shard out of the quantized tensors (row-parallel layers a whole number of
groups, desc_act's features with their g_idx and every group's scales, each expert's slice).
A rank whose share of a row-parallel weight ends inside a group holds it in smaller groups, each
with its group's scale and zero point (the same weights), down to groups of 32; below that the
load stops, naming the tensor-parallel sizes that work."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from quant_parity import assert_same_tokens, greedy, pair, source, transformers_greedy

from minisgl import LLM
from minisgl.quant.attach import _holder
from minisgl.quant.qtensor import dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.testing.quant_writer import LINEAR, QuantFormat

pytestmark = pytest.mark.timeout(300)


def test_gptq_desc_act_dense(tmp_path: Path) -> None:
    fmt = QuantFormat("gptq", group_size=64, sym=False, desc_act=True)
    quant, twin = pair("quant", fmt, tmp_path)
    assert_same_tokens(quant, twin, tp_size=2)


def test_gptq_experts(tmp_path: Path) -> None:
    # Group 64: each rank's half of an expert's 128 down_proj inputs is a whole group.
    quant, twin = pair("quant-moe", QuantFormat("gptq", group_size=64, sym=False), tmp_path)
    assert_same_tokens(quant, twin, tp_size=2)


@pytest.mark.parametrize(("method", "ranks"), [("int4", 2), ("int4", 8), ("fp8", 2), ("fp8", 4)])
def test_each_rank_holds_its_features_weights_bit_for_bit(method: str, ranks: int) -> None:
    """768 input features (Qwen3-30B-A3B's experts' down_proj) over `ranks`: 384 (whole groups
    of 128), 96 (groups of 32), 384 and 192 (fp8's 128-wide blocks cut into 64s) a rank."""
    scheme = load_scheme(method)
    w = torch.randn(256, 768, generator=torch.Generator().manual_seed(0))
    q = quantize(w, scheme)
    whole = dequantize(q, torch.float32)
    k = 768 // ranks
    for r in range(ranks):
        held = _holder(scheme, 256, k, 768, True).to_empty(device="cpu")
        held.copy_(q.narrow(1, r * k, k))
        assert held.group_size == math.gcd(128, k)
        assert torch.equal(dequantize(held.view(), torch.float32), whole[:, r * k : (r + 1) * k])


def _int4_twin(preset: str, out: Path) -> Path:
    """The float checkpoint of what --quantization int4 makes of `preset`'s linears."""
    from safetensors.torch import load_file, save_file

    src = source(preset)
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    scheme = load_scheme("int4")
    for name, t in tensors.items():
        if LINEAR.fullmatch(name):
            tensors[name] = dequantize(quantize(t, scheme), torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


# (preset, checkpoint format; None: a float checkpoint under --quantization int4). quant-split's
# down_proj: 192 of 384 input features a rank, groups of 64; quant-moe-split's experts: 96 of
# 192, groups of 32 (and its dense layer's down_proj as quant-split's).
CUT_GROUPS = {
    "awq dense": ("quant-split", QuantFormat("awq")),
    "gptq asym dense": ("quant-split", QuantFormat("gptq", sym=False)),
    "gptq 8-bit dense": ("quant-split", QuantFormat("gptq", bits=8)),
    "compressed-tensors w4a16 asym dense": ("quant-split", QuantFormat("ct-pack", sym=False)),
    # mixed precision: down_proj (the weight cut here) in 8 bits, the rest in 4
    "gptq 4-bit, 8-bit down_proj, dense": (
        "quant-split",
        QuantFormat("gptq", mixed=((r".*down_proj", QuantFormat("gptq", bits=8)),)),
    ),
    "int4 at load dense": ("quant-split", None),
    "gptq asym experts": ("quant-moe-split", QuantFormat("gptq", sym=False)),
    "int4 at load experts": ("quant-moe-split", None),
}


@pytest.mark.parametrize("name", list(CUT_GROUPS))
def test_tp2_cutting_groups_generates_the_dequantized_weights_tokens(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    preset, fmt = CUT_GROUPS[name]
    if fmt is None:
        quant, flags = source(preset), {"quantization": "int4", "lm_head_quantization": "none"}
        twin = _int4_twin(preset, tmp_path / "twin")
    else:
        (quant, twin), flags = pair(preset, fmt, tmp_path), {}
    one, _ = greedy(quant, **flags)
    with caplog.at_level(logging.INFO, logger="minisgl.quant.attach"):
        two, _ = greedy(quant, tp_size=2, **flags)
    assert two == one
    assert one == transformers_greedy(twin)
    cut = "experts' down_proj" if preset == "quant-moe-split" else "down_proj"
    lines = [r.message for r in caplog.records if "cut by tensor parallelism" in r.message]
    assert len(lines) == 1  # rank 0's, once, not one a layer
    assert f"{cut} (" in lines[0] and "held in groups of" in lines[0]


def test_a_split_into_groups_no_kernel_takes_is_refused(tmp_path: Path) -> None:
    # TP=4: 48 of an expert's 192 down_proj inputs a rank, groups of gcd(128, 48) = 16.
    quant, _ = pair("quant-moe-split", QuantFormat("gptq"), tmp_path)
    with pytest.raises(Exception, match=r"groups of 16.*such groups: 1, 2, 3, 6"):
        LLM(str(quant), dtype="float32", num_pages=16, cpu_kernel_tuning="off", tp_size=4)
