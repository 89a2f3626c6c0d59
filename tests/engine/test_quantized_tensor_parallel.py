"""Quantized checkpoints under TP=2 generate exactly the tokens of their dequantized weights:
each rank cuts its shard out of the quantized tensors (row-parallel layers a whole number of
groups, desc_act's features with their g_idx and every group's scales, each expert's slice)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_parity import assert_same_tokens, pair

from minisgl.testing.quant_writer import QuantFormat

pytestmark = pytest.mark.timeout(300)


def test_gptq_desc_act_dense(tmp_path: Path) -> None:
    fmt = QuantFormat("gptq", group_size=64, sym=False, desc_act=True)
    quant, twin = pair("quant", fmt, tmp_path)
    assert_same_tokens(quant, twin, tp_size=2)


def test_gptq_experts(tmp_path: Path) -> None:
    # Group 64: each rank's half of an expert's 128 down_proj inputs is a whole group.
    quant, twin = pair("quant-moe", QuantFormat("gptq", group_size=64, sym=False), tmp_path)
    assert_same_tokens(quant, twin, tp_size=2)


def test_a_split_inside_a_group_is_refused(tmp_path: Path) -> None:
    from minisgl import LLM

    # 128 down_proj inputs per expert, halved by TP=2, in groups of 128: no whole group.
    quant, _ = pair("quant-moe", QuantFormat("gptq"), tmp_path)
    with pytest.raises(Exception, match="not a whole number of the checkpoint's quantization"):
        LLM(str(quant), dtype="float32", num_pages=16, cpu_kernel_tuning="off", tp_size=2)
