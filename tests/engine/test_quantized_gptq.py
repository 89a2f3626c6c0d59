"""GPTQ checkpoints (4 and 8 bits, symmetric or with zero points, groups of 32 to a whole row,
desc_act's scattered groups, v1's zero points stored minus one and v2's as they are) load with
no flag and generate exactly the tokens of their dequantized weights (tensor parallelism: test_quantized_tensor_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

FORMATS = {
    "4-bit sym g128": QuantFormat("gptq"),
    "4-bit asym g64": QuantFormat("gptq", group_size=64, sym=False),
    "4-bit asym g32 desc_act": QuantFormat("gptq", group_size=32, sym=False, desc_act=True),
    "8-bit sym g32": QuantFormat("gptq", bits=8, group_size=32),
    "8-bit asym g-1": QuantFormat("gptq", bits=8, group_size=-1, sym=False),
    "v2 4-bit asym g128 desc_act": QuantFormat("gptq", sym=False, desc_act=True, gptq_v2=True),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)
