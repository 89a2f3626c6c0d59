"""The random models the benchmarks run on, and the memory roofline of a decode step.

`--model-shape` picks a real model's shape (random weights, Qwen's tokenizer); `--num-layers`
cuts its depth so a large shape (Qwen3-30B-A3B: 48 layers, ~61 GB in bf16) fits in memory.
Per-layer costs keep their real proportions; the embedding and LM head weigh more in the total.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

# --model-shape -> fixture preset (minisgl/testing/fixture.py)
MODEL_SHAPES = {"qwen3-0.6b": "0.6b", "qwen3-8b": "8b", "qwen3-30b-a3b": "30b-a3b"}


def fixture(shape: str, dtype: str, root: Path, num_layers: int | None = None) -> Path:
    """Write (once) and return the random checkpoint of `shape`."""
    from minisgl.testing.fixture import PRESETS, write_fixture_model

    preset = MODEL_SHAPES[shape]
    layers = num_layers or PRESETS[preset].num_hidden_layers
    out = root / f"{shape}-{layers}l-{dtype}"
    if not (out / "config.json").is_file():
        # Qwen3-30B-A3B and Qwen3-8B untie their heads; Qwen3-0.6B ties it.
        tied = shape == "qwen3-0.6b"
        write_fixture_model(
            out, preset, dtype=dtype, num_hidden_layers=layers, tie_word_embeddings=tied
        )
    return out


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a reduction over a buffer far larger than the caches streams (best of `repeats`),
    with torch's threads: the machine's read bandwidth as the model's kernels can see it."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def decode_bytes_per_token(model: nn.Module, context: int, kv_dtype: torch.dtype) -> int:
    """Bytes a batch-1 decode step must read: every weight except the embedding table (one row)
    and the experts (k of E per sparse layer), plus the K and V cached for `context` tokens."""
    from minisgl.layers.moe import SparseMoeBlock
    from minisgl.quant.weight import QuantWeight

    total = 0
    seen: set[int] = set()
    expert_params: set[int] = set()
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            e = m.experts
            if isinstance(e.w13, QuantWeight) and isinstance(e.w2, QuantWeight):
                per_expert = (e.w13.nbytes() + e.w2.nbytes()) // e.num_experts
            else:
                per_expert = (e.w13[0].numel() + e.w2[0].numel()) * e.w13.element_size()
            total += m.top_k * per_expert
            expert_params |= {id(e.w13), id(e.w2)}
        elif isinstance(m, QuantWeight) and not m.experts:  # a dense layer's quantized weight
            total += m.nbytes()
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    head = model.lm_head.weight  # type: ignore[union-attr]
    for p in model.parameters():
        if id(p) in seen or id(p) in expert_params:
            continue
        seen.add(id(p))
        if p is embed and p is not head:
            total += p.shape[1] * p.element_size()  # one row looked up
        else:
            total += p.numel() * p.element_size()
    cfg = model.config  # type: ignore[union-attr]
    kv_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_dtype.itemsize
    return total + cfg.num_hidden_layers * context * kv_per_token
