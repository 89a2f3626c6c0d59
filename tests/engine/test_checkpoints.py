"""Checkpoints as users have them: config.json read as transformers reads it (whichever spelling
of a key a transformers release writes), and a checkpoint whose tensors do not fit its
config.json refused in config.json's terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM
from minisgl.models.config import ModelConfig

# The project's writer and transformers' save_pretrained, each for the four architectures.
WRITTEN = {
    ("minisgl", "qwen3"): "tiny_model_dir",
    ("minisgl", "qwen3-moe"): "moe_model_dir",
    ("minisgl", "qwen2"): "qwen2_model_dir",
    ("minisgl", "llama"): "llama_model_dir",
    ("transformers", "qwen3"): "transformers_qwen3_model_dir",
    ("transformers", "qwen3-moe"): "transformers_moe_model_dir",
    ("transformers", "qwen2"): "transformers_qwen2_model_dir",
    ("transformers", "llama"): "transformers_llama_model_dir",
}


@pytest.mark.parametrize("writer, arch", list(WRITTEN))
def test_config_reads_as_transformers_reads_it(
    request: pytest.FixtureRequest, writer: str, arch: str
) -> None:
    from transformers import AutoConfig

    path = request.getfixturevalue(WRITTEN[writer, arch])
    ours = ModelConfig.from_dir(path)
    theirs = AutoConfig.from_pretrained(path)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == head_dim
    if arch == "qwen3-moe":
        # transformers 5 writes num_local_experts; the hub's checkpoints say num_experts.
        assert ours.num_experts == theirs.num_experts == 16
        assert (ours.num_experts_per_tok, ours.moe_intermediate_size) == (4, 32)
        assert ours.norm_topk_prob is True and ours.mlp_only_layers == (1,)
        assert [ours.is_moe_layer(i) for i in range(3)] == [True, False, True]
    else:
        assert ours.num_experts == 0
    if arch == "llama":
        assert ours.rope_theta == 500_000.0
        assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == "llama3"
        assert ours.rope_scaling["factor"] == 8.0
    else:
        assert ours.rope_theta == 1_000_000.0 and ours.rope_scaling is None
    assert ours.torch_dtype == "float32" and ours.eos_token_ids == [151645, 151643]


BASE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
}


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_expert_count_under_either_name(key: str) -> None:
    """Older checkpoints (Qwen3-30B-A3B on the hub) say num_experts, transformers 5 writes
    num_local_experts: both are the same count."""
    config = ModelConfig.from_dict({**BASE, key: 6})
    assert config.num_experts == 6 and config.is_moe_layer(0)


def _with_config(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes: Any) -> Path:
    """`src`'s checkpoint (its files linked, not copied) under an edited config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    raw = json.loads((src / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in drop} | changes
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _refused(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", device="cpu", num_pages=16)
    message = str(info.value)
    assert f"checkpoint {path}" in message and "config.json" in message
    return message


MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_local_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
}


def test_moe_config_over_a_dense_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    message = _refused(_with_config(tiny_model_dir, tmp_path / "m", **MOE))
    assert "config.json declares 16 experts per layer (num_experts / num_local_experts)" in message
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in message
    assert "a dense MLP there (model.layers.0.mlp.gate_proj.weight)" in message


def test_fewer_experts_in_the_checkpoint_than_its_config(
    transformers_moe_model_dir: Path, tmp_path: Path
) -> None:
    # The router says 16; the config asks for 24: the router's shape is named in config terms.
    message = _refused(
        _with_config(transformers_moe_model_dir, tmp_path / "m", num_local_experts=24)
    )
    assert "model.layers.0.mlp.gate.weight is [16, 64] in the checkpoint" in message
    assert "config.json implies [24, 64] (num_experts / num_local_experts=24" in message
    assert "layer 0 of the checkpoint has 16 experts" in message


def test_dense_config_over_an_moe_checkpoint(moe_model_dir: Path, tmp_path: Path) -> None:
    path = _with_config(
        moe_model_dir, tmp_path / "m", architectures=["Qwen3ForCausalLM"], model_type="qwen3"
    )
    message = _refused(path)
    assert "config.json declares layer 0 dense (Qwen3ForCausalLM has no experts)" in message
    assert "the checkpoint has experts there (model.layers.0.mlp.experts." in message


def test_layer_count_differs(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    message = _refused(_with_config(tiny_model_dir, tmp_path / "more", num_hidden_layers=3))
    assert "config.json declares num_hidden_layers=3" in message
    assert "no tensors for layer 2 (model.layers.2.*): it has 2 layers" in message
    # Fewer layers than the checkpoint is how a model is cut down for a quick test: it runs,
    # as in transformers, and says which layers it leaves out.
    fewer = _with_config(tiny_model_dir, tmp_path / "fewer", num_hidden_layers=1)
    with caplog.at_level("WARNING", logger="minisgl.models.loader"):
        LLM(str(fewer), dtype="float32", device="cpu", num_pages=16)
    assert f"checkpoint {fewer}: config.json declares num_hidden_layers=1; the checkpoint's " in (
        caplog.text
    )
    assert "layer 1 (model.layers.1.*) is not used" in caplog.text


def test_head_count_differs(tiny_model_dir: Path, tmp_path: Path) -> None:
    message = _refused(_with_config(tiny_model_dir, tmp_path / "m", num_attention_heads=8))
    assert "model.layers.0.self_attn.q_proj.weight is [128, 64] in the checkpoint" in message
    assert (
        "config.json implies [256, 64] (num_attention_heads=8 x head_dim=32, hidden_size=64)"
        in (message)
    )


def test_untied_config_over_a_tied_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    message = _refused(_with_config(tiny_model_dir, tmp_path / "m", tie_word_embeddings=False))
    assert "config.json declares tie_word_embeddings=false" in message
    assert "no tensor lm_head.weight" in message


def test_qwen3_config_over_a_llama_checkpoint(llama_model_dir: Path, tmp_path: Path) -> None:
    path = _with_config(
        llama_model_dir,
        tmp_path / "m",
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=16,
    )
    message = _refused(path)
    assert "Qwen3ForCausalLM (config.json's architectures) normalises q and k per head" in message
    assert "model.layers.0.self_attn.q_norm.weight" in message
