"""Qwen3-MoE checkpoints with quantized experts (FP8 blocks, GPTQ-Int4) load with no flag, the
router and the LM head in float, and generate exactly the tokens of their dequantized
weights; under TP=2 each rank holds its slice of every quantized expert."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

FORMATS = {
    "fp8 block 128": QuantFormat("fp8"),
    "gptq int4 g128": QuantFormat("gptq"),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant-moe", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)
