"""Intel AutoRound checkpoints (`quant_method: auto-round`: its int codes in GPTQ's or AutoAWQ's
layout) load with no flag and generate exactly the tokens of their dequantized weights, dense
and Qwen3-MoE experts, with the layers its extra_config keeps in 16 bits in float."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

UNQUANTIZED_MLP = tuple(f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down"))
FORMATS = {
    "auto_gptq 4-bit sym g128": QuantFormat("gptq", auto_round=True),
    # The same codes with the zero points stored as they are (8), not minus one: read alike.
    "auto_gptq 4-bit sym g128, zeros as they are": QuantFormat(
        "gptq", auto_round=True, gptq_v2=True
    ),
    "auto_gptq 8-bit asym g64, layer 1's MLP in 16 bits": QuantFormat(
        "gptq", bits=8, group_size=64, sym=False, auto_round=True, not_converted=UNQUANTIZED_MLP
    ),
    "auto_awq 4-bit g128": QuantFormat("awq", sym=False, auto_round=True),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)


def test_moe_experts_in_auto_gptq(tmp_path: Path) -> None:
    quant, twin = pair("quant-moe", FORMATS["auto_gptq 4-bit sym g128"], tmp_path)
    assert_same_tokens(quant, twin)
