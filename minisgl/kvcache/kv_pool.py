"""The KV cache tensors: per layer, one K and one V buffer of num_pages * page_size token slots.

Slot arithmetic (shared by every attention backend): the token at position p of a request whose
page table is pt lives in slot pt[p // page_size] * page_size + p % page_size. Which pages a
request owns is the allocator's business (page_allocator.py); this class only holds memory.
"""

from __future__ import annotations

import torch

from minisgl import hugepages
from minisgl.layers import cpu_kernels


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads  # this rank's share
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: a padded gather may read a never-written slot (it is masked out,
        # but NaN garbage times a zero weight would still poison the sum). On the CPU on huge
        # pages: decode attention streams every layer's buffers each step.
        self.k_buffers = [hugepages.zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [hugepages.zeros(shape, dtype, device) for _ in range(num_layers)]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer_id`'s K and V rows at `slots` [T] = k, v [T, Hkv, D]. On CPU one pass
        of row copies from where k and v lie (views of the fused qkv output; index_copy_ from
        such strided views goes element by element: ~3% of a CPU prefill step)."""
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if cpu_kernels.kv_store_supported(k_buf, k, v):
            cpu_kernels.kv_store(k_buf, v_buf, slots, k, v)
            return
        k_buf.index_copy_(0, slots, k)
        v_buf.index_copy_(0, slots, v)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element
