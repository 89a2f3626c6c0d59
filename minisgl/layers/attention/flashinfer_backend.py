"""Paged attention on CUDA with FlashInfer (optional dependency, imported only when chosen).

One `BatchPrefillWithPagedKVCacheWrapper` serves the whole mixed batch: decodes are append
steps of one query. Our pool's flat [slots, H, D] buffers are FlashInfer's NHD page layout
viewed as [pages, page_size, H, D], so no copy is needed; the step's new K/V are written with
the same slot arithmetic as the torch backend, then FlashInfer attends causally (queries
aligned to the end of each request's KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from minisgl.layers.attention.paged_plan import build_paged_plan, upload

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferMetadata(AttentionMetadata):
    out_loc: torch.Tensor  # [T] pool slot of each new token


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        if kv_pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
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
            kv_data_type=self.kv_pool.dtype,
        )
        return FlashInferMetadata(out_loc=upload(plan.out_loc, self.device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, FlashInferMetadata)
        self.kv_pool.k_buffers[layer_id].index_copy_(0, meta.out_loc, k)
        self.kv_pool.v_buffers[layer_id].index_copy_(0, meta.out_loc, v)
        o = self.wrapper.run(q.contiguous(), self.caches[layer_id])
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
