"""The model's shape and constants, read from a Hugging Face `config.json` through
transformers' config class for its architecture (imported when a config is read: importing
this module stays torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.models.registry import (
    ARCHITECTURES,
    config_class,
    has_experts,
    supported_architecture,
)
from minisgl.quant.scheme import QuantScheme, parse_quantization_config

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
    # config.json's quantization_config (None: float weights); see minisgl/quant/scheme.py.
    quantization: QuantScheme | None = None

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
        """Read through transformers' own config class for the architecture: whichever name a
        transformers release writes a key under (Qwen3-MoE's expert count is `num_experts` on
        the hub and `num_local_experts` from transformers 5 on), and whatever default it gives
        a missing key, are what transformers itself would run the checkpoint with."""
        archs = list(raw.get("architectures") or [])
        arch = supported_architecture(archs)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                f"minisgl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hf = config_class(arch).from_dict(raw)
        # A dense architecture's model has no experts, whatever MoE keys its config.json carries.
        moe: Any = hf if has_experts(arch) else None
        if getattr(hf, "mlp_bias", False):
            raise ValueError("unsupported model: mlp_bias=true (minisgl's MLPs have no bias)")
        heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        theta, scaling = _rope(
            getattr(hf, "rope_parameters", None),
            getattr(hf, "rope_scaling", None),
            getattr(hf, "rope_theta", None),
        )
        eos = (generation or {}).get("eos_token_id", hf.eos_token_id)
        if eos is None:
            eos_ids: list[int] = []
        elif isinstance(eos, int):
            eos_ids = [eos]
        else:
            eos_ids = [int(e) for e in eos]
        # transformers >= 4.56 calls it dtype (a torch.dtype once read; reading torch_dtype
        # there warns), older ones torch_dtype; with none named HF's default is float32.
        named = hf.dtype if hasattr(hf, "dtype") else getattr(hf, "torch_dtype", None)
        dtype = named or "float32"
        return cls(
            architectures=archs,
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf.intermediate_size),
            num_hidden_layers=int(hf.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.num_key_value_heads or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            torch_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=eos_ids,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            # Qwen3-MoE's attribute_map makes num_experts read num_local_experts (5.x).
            num_experts=int(getattr(moe, "num_experts", 0) or 0),
            num_experts_per_tok=int(getattr(moe, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(getattr(moe, "moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(getattr(moe, "norm_topk_prob", False)),
            decoder_sparse_step=int(getattr(moe, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in getattr(moe, "mlp_only_layers", None) or ()),
            quantization=parse_quantization_config(raw.get("quantization_config")),
        )


def _rope(
    parameters: dict[str, Any] | None,
    rope_scaling: dict[str, Any] | None,
    rope_theta: float | None,
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5's `rope_parameters` or the classic
    attributes of older releases; plain RoPE is reported as None."""
    params = dict(parameters or {})
    scaling = dict(rope_scaling or {}) or params
    theta = float(params.get("rope_theta", rope_theta if rope_theta is not None else 10000.0))
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
