"""Attention backends by name: "torch" (always available), "flashinfer" (CUDA, optional), "auto"."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
)


def _torch() -> type[AttentionBackend]:
    from minisgl.layers.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


def _flashinfer() -> type[AttentionBackend]:
    # Imported only when chosen: flashinfer is optional and CUDA-only.
    from minisgl.layers.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend


BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _torch,
    "flashinfer": _flashinfer,
}


def resolve_backend_name(name: str, device_type: str) -> str:
    if name != "auto":
        return name
    if device_type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def create_attention_backend(
    name: str,
    kv_pool: KVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
) -> AttentionBackend:
    name = resolve_backend_name(name, kv_pool.device.type)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    cls = BACKENDS[name]()
    return cls(kv_pool, num_heads, num_kv_heads, head_dim, scale)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BatchLayout",
    "create_attention_backend",
    "resolve_backend_name",
]
