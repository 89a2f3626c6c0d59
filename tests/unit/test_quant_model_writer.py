"""The layer-by-layer quantized checkpoint writer (benchmarks/big_moe_memory.py writes a
Qwen3-30B-A3B shape with it): one shard per decoder layer, the same tensors as quantizing the
whole float fixture at once, and a random-codes checkpoint that minisgl loads and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model
from minisgl.testing.fixture import write_fixture_model
from minisgl.testing.quant_model_writer import FORMATS, write_quantized_model
from minisgl.testing.quant_writer import write_quantized_pair

pytestmark = pytest.mark.timeout(300)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_layer_by_layer_equals_quantizing_the_whole_float_model(tmp_path: Path) -> None:
    fmt = "gptq"  # the others go through the same per-linear functions of quant_writer.py
    kw = {"dtype": "bfloat16", "tie_word_embeddings": False}
    src = write_fixture_model(tmp_path / "float", "quant-moe", **kw)
    write_quantized_pair(src, tmp_path / "whole", tmp_path / "twin", FORMATS[fmt])
    out = write_quantized_model(tmp_path / "layers", "quant-moe", FORMATS[fmt], **kw)

    whole, layers = _tensors(tmp_path / "whole"), _tensors(out)
    assert sorted(layers) == sorted(whole)
    for name, t in whole.items():
        assert layers[name].dtype == t.dtype, name
        assert torch.equal(layers[name].view(torch.uint8), t.view(torch.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tmp_path / "whole" / "config.json").read_text())
    # One shard per decoder layer (plus the embedding's and the head's), listed in the index.
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layers_in = {}
    for name, shard in weight_map.items():
        if name.startswith("model.layers."):
            layers_in.setdefault(shard, set()).add(name.split(".")[2])
    assert sorted(len(v) for v in layers_in.values()) == [1, 1]
    assert len(set(weight_map.values())) == 4


def test_random_codes_checkpoint_loads(tmp_path: Path) -> None:
    out = write_quantized_model(tmp_path / "codes", "quant-moe", FORMATS["gptq"], source="codes")
    model = load_model(out, ModelConfig.from_dir(out), torch.float32, torch.device("cpu"),
                       progress=False, prepack=False)  # fmt: skip
    held = dict(model.named_buffers())
    # The experts and projections are held as 4-bit codes (half a byte per weight), with
    # scales near the preset's std / 4.6 (uniform codes' std in units of scale).
    w13 = held["model.layers.0.mlp.experts.w13.codes"]
    assert w13.dtype == torch.uint8 and tuple(w13.shape) == (8, 256, 64)
    assert len({int(b) for b in w13.flatten()[:4096]}) == 256  # every pair of codes occurs
    scales = held["model.layers.1.mlp.down_proj.weight.scales"]
    assert 0.9 * 0.5 / 4.61 < float(scales.min()) <= float(scales.max()) < 1.1 * 0.5 / 4.6
