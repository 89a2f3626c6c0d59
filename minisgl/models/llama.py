"""Llama 3 (3.0-3.3): Qwen3's decoder without the q/k norm; q, k, v and o biased only when
`attention_bias` says so. Its "llama3" RoPE scaling lives in layers/rotary.py, and a tied head
(Llama 3.2 1B/3B) goes through `tie_word_embeddings` as for Qwen3."""

from __future__ import annotations

from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import AttentionOptions, Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qk_norm=False, qkv_bias=bias, o_bias=bias)
