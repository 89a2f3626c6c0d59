"""Qwen3-MoE checkpoints with quantized experts (FP8 blocks, GPTQ-Int4) load with no flag, the
router and the LM head in float, and generate exactly the tokens of their dequantized
weights; under TP=2 each rank holds its slice of every quantized expert."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_parity import (
    assert_same_tokens,
    needs_amx_vpanel,
    needs_fp8_panel,
    needs_vnni_panel,
    pair,
)

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


@needs_vnni_panel
@pytest.mark.parametrize(
    ("name", "dtype"),
    # 4-bit in fp32: exact; in bf16 this random mixture's logits move by up to ~0.15 between
    # any two kernel choices (qgemv forced included), more than quant_parity's tie margin
    [
        ("gptq int4 g128", "float32"),
        pytest.param("fp8 block 128", "bfloat16", marks=needs_fp8_panel),
    ],
)
def test_experts_in_vnni_panels_generate_the_twins_tokens(
    name: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized weight repacked into VNNI panels, the experts one by one: the decode
    steps' experts through the panels in one call (the decode chain's), prefill's one by one,
    and the twin's tokens."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")
    quant, twin = pair("quant-moe", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin, dtype=dtype)


@needs_amx_vpanel
def test_experts_in_panels_on_amx_tiles_generate_the_twins_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with every row count's pick the panels' AMX-INT8 form (vnni_panel's bits):
    the decode steps' experts through it in one call, prefill's one by one, the twin's
    tokens."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "amx_vpanel")
    quant, twin = pair("quant-moe", FORMATS["gptq int4 g128"], tmp_path)
    assert_same_tokens(quant, twin, dtype="float32")
