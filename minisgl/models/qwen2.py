"""Qwen2 / Qwen2.5 (Qwen2.5-Coder included): Qwen3's decoder without the q/k norm, with a bias
on the q, k and v projections (none on o)."""

from __future__ import annotations

from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import AttentionOptions, Qwen3ForCausalLM


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qk_norm=False, qkv_bias=True, o_bias=False)
