"""FP8 and AWQ checkpoints in the published layouts load with no flag and generate exactly
the tokens of their dequantized weights; a stray tensor stops the load, named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_parity import assert_same_tokens, pair

from minisgl import LLM
from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

FORMATS = {
    "fp8 block 128": QuantFormat("fp8"),
    "compressed-tensors fp8 channel": QuantFormat("ct-fp8-channel"),
    "compressed-tensors fp8 tensor": QuantFormat("ct-fp8-tensor"),
    "awq g128": QuantFormat("awq"),
    # Layer 1's MLP kept in float (modules_to_not_convert), as some releases do.
    "awq g64, one MLP unconverted": QuantFormat(
        "awq",
        group_size=64,
        not_converted=tuple(f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")),
    ),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)


def test_fp8_in_bfloat16(tmp_path: Path) -> None:
    """Qwen's FP8 releases run in bf16: the dequantized blocks rounded as the twin's are."""
    quant, twin = pair("quant", QuantFormat("fp8"), tmp_path)
    assert_same_tokens(quant, twin, dtype="bfloat16")


def test_an_extra_scale_tensor_stops_the_load(tmp_path: Path) -> None:
    stray = {"model.layers.1.mlp.down_proj.weight_scale": torch.ones(1)}
    quant, _ = pair("quant", QuantFormat("fp8"), tmp_path, extra=stray)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight_scale is not used"):
        LLM(str(quant), dtype="float32", num_pages=16, cpu_kernel_tuning="off")


def test_quantized_tensors_without_quantization_config_stop_the_load(tmp_path: Path) -> None:
    """The bug this fixed: fp8 codes cast to float and their scales ignored, silently."""
    quant, _ = pair("quant", QuantFormat("fp8"), tmp_path)
    config = (quant / "config.json").read_text()
    (quant / "config.json").write_text(config.replace('"quantization_config"', '"unused"'))
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        LLM(str(quant), dtype="float32", num_pages=16, cpu_kernel_tuning="off")
