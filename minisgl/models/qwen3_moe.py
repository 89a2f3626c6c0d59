"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, sparse expert MLPs.

A layer is sparse unless `mlp_only_layers` lists it or `decoder_sparse_step` skips it (then it
has a dense MLP of `intermediate_size`); a sparse layer routes each token to
`num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size`
(layers/moe.py).
"""

from __future__ import annotations

from torch import nn

from minisgl.layers.moe import SparseMoeBlock
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import Qwen3ForCausalLM, dense_mlp


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
        if not config.is_moe_layer(layer_id):
            return dense_mlp(config, layer_id, tp_rank, tp_size)
        return SparseMoeBlock(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            config.norm_topk_prob,
            tp_rank,
            tp_size,
        )
