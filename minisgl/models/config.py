"""The model's shape and constants, read from a Hugging Face `config.json` (torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.models.registry import ARCHITECTURES, supported_architecture

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# rope_type values RotaryEmbedding implements ("default" and None mean plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)
    # Bias on q, k, v and o (Qwen3, Llama: `attention_bias`; Qwen2 always biases q, k, v).
    attention_bias: bool = False
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def architecture(self) -> str:
        """The entry of `architectures` that picks the model class (see registry.py)."""
        arch = supported_architecture(self.architectures)
        assert arch is not None  # from_dict refuses the others
        return arch

    def is_moe_layer(self, layer_id: int) -> bool:
        """transformers' rule: sparse unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer (1-based)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = list(raw.get("architectures") or [])
        if supported_architecture(archs) is None:
            raise ValueError(
                f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                f"minisgl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        if raw.get("mlp_bias"):
            raise ValueError("unsupported model: mlp_bias=true (minisgl's MLPs have no bias)")
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        if eos is None:
            eos_ids: list[int] = []
        elif isinstance(eos, int):
            eos_ids = [eos]
        else:
            eos_ids = [int(e) for e in eos]
        return cls(
            architectures=archs,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # transformers >= 5 writes "dtype"; older checkpoints "torch_dtype"; HF's default
            # when neither is present is float32.
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=int(raw.get("num_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers 5's
    `rope_parameters`; plain RoPE is reported as None."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r}; minisgl supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling
