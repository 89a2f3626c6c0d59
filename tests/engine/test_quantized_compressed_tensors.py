"""compressed-tensors checkpoints with integer weights (llm-compressor's W4A16, W8A16 and W8A8,
the layout of RedHatAI's Qwen3 `quantized.w4a16` / `w8a8` releases) load with no flag and
generate exactly the tokens of their dequantized weights, dense and Qwen3-MoE experts; and a
checkpoint compressed-tensors itself writes generates transformers' tokens on it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from quant_parity import assert_same_tokens, greedy, pair, source, transformers_greedy

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

FORMATS = {
    "w4a16 group 128": QuantFormat("ct-pack"),
    "w4a16 group 64, zero points": QuantFormat("ct-pack", group_size=64, sym=False),
    "w4a16 group 128, actorder group": QuantFormat("ct-pack", desc_act=True),
    "w8a16 per channel": QuantFormat("ct-pack", bits=8, group_size=-1),
    "w8a8 per channel": QuantFormat("ct-int8", bits=8, group_size=-1),
    "w8a8 per tensor": QuantFormat("ct-int8", bits=8, group_size=0),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)


def test_moe_experts_in_w4a16(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every expert packed (the router and the LM head in float, as llm-compressor's Qwen3-MoE
    recipes leave them), and the start-up log names the format."""
    quant, twin = pair("quant-moe", FORMATS["w4a16 group 128"], tmp_path)
    with caplog.at_level(logging.INFO, logger="minisgl"):
        assert_same_tokens(quant, twin)
    assert "compressed-tensors pack-quantized 4-bit, group 128, symmetric" in caplog.text


def _library_checkpoint(out: Path, kind: str) -> Path:
    """The fixture quantized and saved by compressed-tensors itself, as llm-compressor does
    after calibrating (its min-max observer's scales: calculate_qparams over each group or
    row), in the model's float32, so the weights it encodes are exact in float32."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    src = source("quant")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if kind == "w4a16":
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=128)
        acts, fmt = None, "pack-quantized"
    else:
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True)
        fmt = "int-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.data
        parts = w.view(w.shape[0], -1, weights.group_size or w.shape[1])
        scale, _ = calculate_qparams(parts.amin(-1), parts.amax(-1), weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for f in src.iterdir():  # the tokenizer's files
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def _weights_only(model: torch.nn.Module) -> None:
    """compressed-tensors' run-time activation rounding (W8A8's) off, as minisgl's exact path
    has it: the weights, decompressed as transformers loads them, alone."""
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_enabled = False


@pytest.mark.parametrize("kind", ["w4a16", "w8a8"])
def test_a_checkpoint_compressed_tensors_writes_generates_transformers_tokens(
    kind: str, tmp_path: Path
) -> None:
    path = _library_checkpoint(tmp_path / kind, kind)
    ours, _ = greedy(path)
    assert ours == transformers_greedy(path, _weights_only)
