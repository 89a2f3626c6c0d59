"""Paged attention on CUDA with FlashInfer (optional dependency, imported only when chosen).

One `BatchPrefillWithPagedKVCacheWrapper` serves the whole mixed batch: decodes are append
steps of one query. Our pool's flat [slots, H, D] buffers are FlashInfer's NHD page layout
viewed as [pages, page_size, H, D], so no copy is needed; the step's new K/V are written with
the same slot arithmetic as the torch backend, then FlashInfer attends causally (queries
aligned to the end of each request's KV).

Decode steps replayed as CUDA graphs (engine/cuda_graph.py) use one
`BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)` per batch-size bucket instead: its page
indices live in buffers allocated here once, which plan() refills before each replay, and the
new tokens' slots in a static tensor the captured K/V stores read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from minisgl.layers.attention.paged_plan import build_paged_plan, upload

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferMetadata(AttentionMetadata):
    out_loc: torch.Tensor  # [T] pool slot of each new token


@dataclass
class FlashInferDecodeMetadata(FlashInferMetadata):
    """A CUDA-graph bucket's: static tensors, the same at every replay."""

    wrapper: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper planned for this bucket


# Devices this backend runs on (tests widen it to run a pure-torch stand-in of flashinfer).
DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        if kv_pool.device.type not in DEVICE_TYPES:
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        # Zeroed: flashinfer asks for a zero workspace before its first use. Shared by every
        # wrapper here: they run one after another on one stream.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_meta: dict[int, FlashInferDecodeMetadata] = {}
        shape = (kv_pool.num_pages, kv_pool.page_size, num_kv_heads, head_dim)
        self.caches = [
            (k.view(shape), v.view(shape))
            for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers, strict=True)
        ]

    def prepare(self, layout: BatchLayout) -> FlashInferMetadata:
        # Host tensors, pinned: plan() reads them where they are (device ones it would copy
        # back, waiting on the GPU each time) and uploads what its kernels need without a stall.
        plan = build_paged_plan(layout, pin=self.device.type == "cuda")
        self.wrapper.plan(
            plan.qo_indptr,
            plan.kv_indptr,
            plan.indices,
            plan.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layout.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.kv_pool.dtype,
            kv_data_type=self.kv_pool.cache_dtype,
        )
        return FlashInferMetadata(out_loc=upload(plan.out_loc, self.device))

    # -- CUDA-graph decode (the DecodeGraphAttention protocol of engine/cuda_graph.py) ------
    def init_decode_graphs(self, buckets: Sequence[int], max_pages_per_seq: int) -> None:
        import flashinfer

        max_bs, dev = max(buckets), self.device
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        # Every request of the largest bucket at full length (shared prefix pages count once
        # per request that reads them).
        indices = torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=dev)
        last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        out_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        for b in buckets:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr[: b + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:b],
            )
            self.graph_meta[b] = FlashInferDecodeMetadata(out_loc=out_loc[:b], wrapper=wrapper)

    def prepare_decode_graph(self, layout: BatchLayout, bucket: int) -> FlashInferDecodeMetadata:
        plan = build_paged_plan(layout)  # one new token per request
        meta = self.graph_meta[bucket]
        # Host tensors: in CUDA-graph mode plan() copies them into the buffers given at
        # construction (the ones the captured kernels read).
        meta.wrapper.plan(
            plan.kv_indptr,
            plan.indices,
            plan.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layout.page_size,
            sm_scale=self.scale,
            q_data_type=self.kv_pool.dtype,
            kv_data_type=self.kv_pool.cache_dtype,
        )
        meta.out_loc.copy_(torch.from_numpy(plan.out_loc))
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, FlashInferMetadata)
        self.kv_pool.store(layer_id, meta.out_loc, k, v)
        wrapper = meta.wrapper if isinstance(meta, FlashInferDecodeMetadata) else self.wrapper
        o = wrapper.run(q.contiguous(), self.caches[layer_id])
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
