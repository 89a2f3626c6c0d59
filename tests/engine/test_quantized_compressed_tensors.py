"""compressed-tensors checkpoints with integer weights (llm-compressor's W4A16, W8A16 and W8A8,
the layout of RedHatAI's Qwen3 `quantized.w4a16` / `w8a8` releases) load with no flag and
generate exactly the tokens of their dequantized weights, dense and Qwen3-MoE experts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

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
