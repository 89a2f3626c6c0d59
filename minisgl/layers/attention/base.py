"""The attention backend contract.

Once per step the engine describes the batch (`BatchLayout`, plain lists) and the backend turns
it into device tensors (`prepare` -> `AttentionMetadata`). Every layer then calls `forward`,
which stores the step's new K/V into the paged pool and attends causally over each request's
cached prefix plus its new tokens. Python work is O(requests) per step in `prepare` and O(1)
per layer in `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.kvcache.kv_pool import KVPool


@dataclass
class BatchLayout:
    page_size: int
    prefix_lens: list[int]  # tokens already in the KV cache, per request
    extend_lens: list[int]  # new tokens this step, per request (>= 1)
    page_tables: list[list[int]]  # pages covering prefix + extend, per request

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def check_page_tables(layout: BatchLayout) -> None:
    """Every request's pages hold its prefix plus its new tokens: a backend given a shorter
    table would store or read another page's KV (every backend checks, before any device work)."""
    ps = layout.page_size
    for i, (table, p, e) in enumerate(
        zip(layout.page_tables, layout.prefix_lens, layout.extend_lens, strict=True)
    ):
        if len(table) * ps < p + e:
            raise ValueError(f"request {i}: {len(table)} pages of {ps} cannot hold {p + e} tokens")


class AttentionMetadata:
    """Backend-specific tensors for one step (built by `AttentionBackend.prepare`)."""


class AttentionBackend(ABC):
    def __init__(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        self.kv_pool = kv_pool
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = scale
        self.device = kv_pool.device

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> AttentionMetadata:
        """Build the step's device tensors (new tokens' slots, gather indices, masks)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the step's new tokens -> [T, Hq * D]."""
