"""Paged attention on CUDA with FlashInfer (optional dependency, imported only when chosen).

One `BatchPrefillWithPagedKVCacheWrapper` serves the whole mixed batch: decodes are append
steps of one query. Our pool's flat [slots, H, D] buffers are FlashInfer's NHD page layout
viewed as [pages, page_size, H, D], so no copy is needed; the step's new K/V are written with
the same slot arithmetic as the torch backend, then FlashInfer attends causally (queries
aligned to the end of each request's KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout

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
        ps = layout.page_size
        prefix = np.asarray(layout.prefix_lens, dtype=np.int64)
        extend = np.asarray(layout.extend_lens, dtype=np.int64)
        total = prefix + extend
        used_pages = (total + ps - 1) // ps
        indices = np.concatenate(
            [
                np.asarray(t[:n], dtype=np.int64)
                for t, n in zip(layout.page_tables, used_pages, strict=True)
            ]
        )
        qo_indptr = np.concatenate(([0], np.cumsum(extend)))
        kv_indptr = np.concatenate(([0], np.cumsum(used_pages)))
        last_page_len = total - (used_pages - 1) * ps
        dev = self.device

        def i32(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int32)).to(dev)

        self.wrapper.plan(
            i32(qo_indptr),
            i32(kv_indptr),
            i32(indices),
            i32(last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            ps,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.kv_pool.dtype,
            kv_data_type=self.kv_pool.dtype,
        )
        # Slots of the new tokens: page of position p, offset within it.
        n = len(extend)
        req = np.repeat(np.arange(n), extend)
        starts = np.cumsum(extend) - extend
        pos = np.arange(int(extend.sum())) - starts[req] + prefix[req]
        page_of = indices[kv_indptr[req] + pos // ps]
        return FlashInferMetadata(out_loc=torch.from_numpy(page_of * ps + pos % ps).to(dev))

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
