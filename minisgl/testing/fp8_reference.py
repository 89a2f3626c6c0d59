"""The reference for --kv-cache-dtype fp8: transformers' own model with a cache that rounds keys
and values to e4m3 the way the engine's fp8 cache does (nearest, ties to even, clamped to
+-448, no scale), so every attention reads them rounded, the prompt's own too. Used by the fp8
cache's tests and benchmarks/gpu_check.py."""

from __future__ import annotations

from typing import Any

import torch


def rounded(t: torch.Tensor) -> torch.Tensor:
    """`t` as an e4m3 cache gives it back, in t's dtype."""
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).to(t.dtype)


def rounding_cache(config: Any) -> Any:
    """A transformers DynamicCache for a model of `config` whose stored keys and values are
    rounded (pass it to generate() as `cache`)."""
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            return super().update(rounded(k), rounded(v), layer_idx, *args, **kwargs)

    return RoundingCache(config=config)
