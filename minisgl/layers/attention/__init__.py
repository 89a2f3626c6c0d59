"""Attention backends by name: "torch" (always available), "flashinfer" (CUDA, optional), "auto"."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

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


# What flashinfer's kernels take (float32 is not among them).
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def resolve_backend_name(name: str, device_type: str, dtype: torch.dtype) -> str:
    """The backend for `name` ("auto": flashinfer on CUDA when installed and the dtype is one
    it runs, else torch). flashinfer asked for by name on CUDA with a dtype it cannot run is
    refused at start-up with what to change, instead of failing inside a kernel."""
    if name == "flashinfer" and device_type == "cuda" and dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"the flashinfer attention backend runs float16 and bfloat16, not "
            f"{str(dtype).removeprefix('torch.')} (--dtype auto picks float32 for a checkpoint "
            f"that names no dtype): pass --dtype bfloat16, or --attention-backend torch"
        )
    if name != "auto":
        return name
    if (
        device_type == "cuda"
        and dtype in FLASHINFER_DTYPES
        and importlib.util.find_spec("flashinfer") is not None
    ):
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
    name = resolve_backend_name(name, kv_pool.device.type, kv_pool.dtype)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    cls = BACKENDS[name]()
    return cls(kv_pool, num_heads, num_kv_heads, head_dim, scale)


__all__ = [
    "FLASHINFER_DTYPES",
    "AttentionBackend",
    "AttentionMetadata",
    "BatchLayout",
    "create_attention_backend",
    "resolve_backend_name",
]
