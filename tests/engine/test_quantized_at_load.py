"""--quantization int8|int4|fp8 quantizes a float checkpoint's linears as they load: the model
holds only their quantized bytes, and generates exactly the tokens of a float checkpoint of
the quantized-then-dequantized weights."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from quant_parity import greedy, source

from minisgl import LLM
from minisgl.quant.qtensor import dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.quant.weight import QuantWeight
from minisgl.testing.quant_writer import LINEAR, QuantFormat, write_quantized_pair

pytestmark = pytest.mark.timeout(300)


def _twin(method: str, out: Path) -> Path:
    """The float checkpoint of what --quantization `method` makes of the source's weights."""
    from safetensors.torch import load_file, save_file

    src = source("quant")
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    for name, t in tensors.items():
        if LINEAR.fullmatch(name):
            tensors[name] = dequantize(quantize(t, load_scheme(method)), torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_greedy_tokens_equal_the_quantized_then_dequantized_weights(
    method: str, tmp_path: Path
) -> None:
    ours = greedy(source("quant"), quantization=method)
    assert ours == greedy(_twin(method, tmp_path / "twin"))


def test_only_quantized_bytes_are_held(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    with LLM(
        str(source("quant")),
        dtype="float32",
        num_pages=16,
        cpu_kernel_tuning="off",
        quantization="int4",
    ) as llm:
        model = llm.engine.runner.model
        held = [m for m in model.modules() if isinstance(m, QuantWeight)]
        assert len(held) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
        # No float copy of a quantized layer: its only tensors are the codes and scales.
        for m in model.modules():
            if hasattr(m, "weight") and isinstance(m.weight, QuantWeight):
                assert not list(m.parameters(recurse=False))
        codes = sum(m.codes.numel() * m.codes.element_size() for m in held)
        # per layer qkv 512x128, o 128x256, gate_up 512x128, down 128x256; 4 bits each
        assert codes == 2 * (512 * 128 + 128 * 256 + 512 * 128 + 128 * 256) // 2
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "int4 4-bit, group 128, zero points (quantized at load)" in line
    quantized_mib = float(re.search(r"([\d.]+) MiB quantized", line).group(1))
    assert 0 < quantized_mib < 0.25  # 393,216 weights: 1.5 MiB in float32


def test_a_quantized_checkpoint_refuses_the_flag(tmp_path: Path) -> None:
    write_quantized_pair(source("quant"), tmp_path / "q", tmp_path / "t", QuantFormat("awq"))
    with pytest.raises(ValueError, match="--quantization int8 is for float checkpoints"):
        LLM(str(tmp_path / "q"), dtype="float32", cpu_kernel_tuning="off", quantization="int8")
