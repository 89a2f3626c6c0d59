"""The random test checkpoints' shapes, shared by both writers: fixture.py writes the tensors
itself, transformers_writer.py has transformers' `save_pretrained` write them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from minisgl.testing.tokenizer_builder import added_token_id

VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer uses 151,669 of them)
BOS_ID = added_token_id("<|endoftext|>")
EOS_ID = added_token_id("<|im_end|>")
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
NORM_NOISE = 0.05  # norms stay near 1 so activations keep a sane scale


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    std: float
    dtype: str
    arch: str = "qwen3"  # a key of ARCHS
    # Qwen3-MoE only (arch "qwen3_moe").
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None


# arch -> (config.json architectures[0], model_type)
ARCHS = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}

_QUANT = Preset(128, 256, 2, 4, 2, 64, 4096, std=0.5, dtype="float32")
_QUANT_K = replace(_QUANT, hidden_size=256, intermediate_size=512)
_QUANT_MOE = replace(
    _QUANT,
    arch="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    mlp_only_layers=(1,),
)

PRESETS: dict[str, Preset] = {
    # GQA with head counts divisible by 2, so tensor parallel can split it. std 0.5 keeps greedy
    # top-1/top-2 logit margins far from ties, so float reorderings cannot flip a token.
    "tiny": Preset(64, 128, 2, 4, 2, 32, 4096, std=0.5, dtype="float32"),
    # The real Qwen3-0.6B shape, for benchmarks.
    "0.6b": Preset(1024, 3072, 28, 16, 8, 128, 40960, std=0.02, dtype="bfloat16"),
    # 16 experts, top-4; layer 1 dense (mlp_only_layers), so both kinds of layer are exercised.
    "qwen3-moe": Preset(
        64,
        128,
        3,
        4,
        2,
        32,
        4096,
        std=0.5,
        dtype="float32",
        arch="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        mlp_only_layers=(1,),
    ),
    # Qwen2/Llama derive head_dim from hidden_size / heads: 64 / 4.
    "qwen2": Preset(64, 128, 2, 4, 2, 16, 4096, std=0.5, dtype="float32", arch="qwen2"),
    "llama": Preset(
        64,
        128,
        2,
        4,
        2,
        16,
        4096,
        std=0.5,
        dtype="float32",
        arch="llama",
        rope_theta=500_000.0,
        rope_scaling=LLAMA3_ROPE,
    ),
    # Quantized-checkpoint tests: every matmul dimension a multiple of 128 (the published
    # layouts' block and group sizes), otherwise tiny. q 256, kv 128, MLP 256.
    "quant": _QUANT,
    "quant-moe": _QUANT_MOE,
    # Every layer sparse: llama.cpp's converter has no dense layers in a Qwen3-MoE (GGUF tests).
    "quant-moe-sparse": replace(_QUANT_MOE, mlp_only_layers=()),
    # GGUF's K-quants (super-blocks of 256 weights of a row): every matmul's inputs a multiple
    # of 256. q 256, kv 128, MLP 512; the mixture's experts 256 wide.
    "quant-k": _QUANT_K,
    "quant-k-moe-sparse": replace(
        _QUANT_K,
        arch="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
    ),
    # Tensor parallelism cutting quantization groups of 128 (test_quantized_tensor_parallel):
    # MLP 384 -> 192 a rank at TP=2 (Qwen3-30B-A3B's experts at TP=4), groups of 64.
    "quant-split": replace(_QUANT, intermediate_size=384),
    # Its experts' 192 -> 96 a rank at TP=2 (1.5 groups of 128 in all: GPTQ's last group is
    # short), groups of 32; 48 at TP=4, groups of 16, which no kernel takes. Layer 1 dense as above.
    "quant-moe-split": replace(_QUANT_MOE, intermediate_size=384, moe_intermediate_size=192),
    # The real Qwen3-30B-A3B shape (48 layers; benchmarks take fewer with num_hidden_layers).
    "30b-a3b": Preset(
        2048,
        6144,
        48,
        32,
        4,
        128,
        40960,
        std=0.02,
        dtype="bfloat16",
        arch="qwen3_moe",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # The real Qwen3-8B shape (its head untied), for benchmarks; --num-layers cuts its depth.
    "8b": Preset(4096, 12288, 36, 32, 8, 128, 40960, std=0.02, dtype="bfloat16"),
}
