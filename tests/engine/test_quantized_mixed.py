"""Mixed-precision checkpoints, each module in the format its config names (compressed-tensors'
config_groups, GPTQModel's `dynamic`, AutoRound's extra_config), load with no flag and generate
exactly the tokens of their dequantized weights; modules minisgl runs as one matmul (q/k/v,
gate/up) stored in two formats are held in parts, each in its own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)

W4 = QuantFormat("gptq")
W8_G64 = QuantFormat("gptq", bits=8, group_size=64)
FORMATS = {
    # llm-compressor recipes: attention in W8A8, the MLP in W4A16; or FP8 with a 4-bit MLP
    "compressed-tensors w4a16 + w8a8 attention": QuantFormat(
        "ct-pack", mixed=((r".*self_attn\.", QuantFormat("ct-int8", bits=8, group_size=-1)),)
    ),
    "compressed-tensors fp8 + w4a16 mlp": QuantFormat(
        "ct-fp8-channel", mixed=((r".*\.mlp\.", QuantFormat("ct-pack")),)
    ),
    # GPTQModel's dynamic: down_proj in 8 bits over a 4-bit model
    "gptq 4-bit, down_proj 8-bit": QuantFormat("gptq", mixed=((r".*down_proj", W8_G64),)),
    # AutoRound's extra_config naming each down_proj in 8 bits
    "auto-round 4-bit, down_proj 8-bit": QuantFormat(
        "gptq",
        auto_round=True,
        mixed=((r".*down_proj", QuantFormat("gptq", bits=8, auto_round=True)),),
    ),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_equal_the_dequantized_twin(name: str, tmp_path: Path) -> None:
    quant, twin = pair("quant", FORMATS[name], tmp_path)
    assert_same_tokens(quant, twin)


def test_experts_down_proj_in_8_bits(tmp_path: Path) -> None:
    """A mixture's experts' gate/up in 4 bits and down_proj in 8: held as two weights of
    their own formats."""
    fmt = QuantFormat("gptq", mixed=((r".*experts\.\d+\.down_proj", W8_G64),))
    quant, twin = pair("quant-moe", fmt, tmp_path)
    assert_same_tokens(quant, twin)


@pytest.mark.parametrize("which", ["k_proj", "v_proj"])
def test_a_fused_module_in_two_formats_is_held_in_parts(
    which: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v with one projection in 8 bits beside 4-bit ones (as a GGUF Q4_K_M file keeps v in
    Q6_K): each run of projections held as its own weight in its own format, the tokens the
    dequantized twin's (a v_proj part in the decode chain, a k_proj one in the layers' path)."""
    fmt = QuantFormat("gptq", mixed=((rf".*self_attn\.{which}", W8_G64),))
    quant, twin = pair("quant", fmt, tmp_path)
    with caplog.at_level(logging.INFO):
        assert_same_tokens(quant, twin)
    parts = 3 if which == "k_proj" else 2
    layers = 2  # the fixture's
    # per layer: the q/k/v parts, gate_up, o_proj, down_proj
    assert f"in {layers * (parts + 3)} weights" in caplog.text
    apart = "a step of 1 rows runs layer by layer: a q/k/v weight held in parts other than"
    assert (apart in caplog.text) == (which == "k_proj")
