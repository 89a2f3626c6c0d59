"""A random checkpoint written by transformers' own `save_pretrained` (fixture.py's
`writer="transformers"`, which adds the tokenizer).

The project's writer (fixture.py) spells config.json the way the checkpoints on the hub were
written; this one lets the installed transformers choose every key and tensor name, so a key
renamed in a new release (transformers 5 writes Qwen3-MoE's expert count as
`num_local_experts`, not `num_experts`) reaches the tests the day CI installs that release.
Both writers take the same presets.

    python -m minisgl.testing.fixture /tmp/moe --preset qwen3-moe --writer transformers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minisgl.testing.presets import ARCHS, BOS_ID, EOS_ID, NORM_NOISE, VOCAB_SIZE, Preset


def _config_kwargs(p: Preset, tied: bool, std: float) -> dict[str, Any]:
    """Constructor arguments of transformers' config class: what they are called in
    config.json is transformers' business."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "tie_word_embeddings": tied,
        # transformers initialises linear and embedding weights with this std: the presets'
        # large std keeps greedy logit margins far from ties.
        "initializer_range": std,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if p.arch != "qwen2":  # Qwen2 derives head_dim from hidden_size / heads
        kwargs["head_dim"] = p.head_dim
    if p.rope_scaling:
        kwargs["rope_scaling"] = dict(p.rope_scaling)
    if p.arch == "qwen3_moe":
        kwargs |= {
            "num_experts": p.num_experts,
            "num_experts_per_tok": p.num_experts_per_tok,
            "moe_intermediate_size": p.moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(p.mlp_only_layers),
        }
    return kwargs


def save_random_model(out: Path, p: Preset, tied: bool, dtype: str, seed: int, std: float) -> None:
    """config.json, generation_config.json and the weights of a random `p`, built by
    transformers' model class and written by its `save_pretrained` (the tokenizer is the
    caller's)."""
    import torch
    import transformers

    arch, model_type = ARCHS[p.arch]
    config = transformers.AutoConfig.for_model(model_type, **_config_kwargs(p, tied, std))
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        # transformers sets every norm to exactly 1: a little noise makes a norm loaded into
        # the wrong place (or not at all) change the output.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(NORM_NOISE * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    # Qwen3 lists both ids, as the project's writer does.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, BOS_ID], pad_token_id=BOS_ID
    )
    model.save_pretrained(out)
