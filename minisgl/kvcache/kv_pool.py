"""The KV cache tensors: per layer, one K and one V buffer of num_pages * page_size token slots.

Slot arithmetic (shared by every attention backend): the token at position p of a request whose
page table is pt lives in slot pt[p // page_size] * page_size + p % page_size. Which pages a
request owns is the allocator's business (page_allocator.py); this class only holds memory.

The buffers hold the model's dtype, or with --kv-cache-dtype fp8 float8 e4m3 (half a bf16
cache's bytes: twice the tokens in the same memory, half the bytes a decode step's attention
reads), as vLLM's and SGLang's fp8 caches without calibrated scales: each value rounded to the
nearest e4m3, clamped to its largest magnitude (448). Attention reads such a cache back in the
model's dtype (`dequantize`, or a kernel that converts as it reads).
"""

from __future__ import annotations

import torch

from minisgl import hugepages
from minisgl.layers import cpu_kernels

# --kv-cache-dtype's names -> the buffers' dtype (auto: the model's).
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8}
FP8_MAX = 448.0


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's buffers' dtype; ValueError naming the choices for another name."""
    if name == "auto":
        return model_dtype
    if name not in CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {name!r}; choose from auto, {', '.join(CACHE_DTYPES)}"
        )
    return CACHE_DTYPES[name]


def kv_cache_name(dtype: torch.dtype) -> str:
    """What a cache of `dtype` holds, as /metrics' model info and the log name it."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


def gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` of a K or V buffer, as held (an fp8 cache's gathered as bytes: index
    kernels lack float8 on some devices)."""
    if buf.dtype == FP8:
        return buf.view(torch.uint8).index_select(0, slots).view(FP8)
    return buf.index_select(0, slots)


def to_fp8(t: torch.Tensor) -> torch.Tensor:
    """Each value rounded to the nearest e4m3 (ties to even), clamped to +-448: a cast alone
    turns a larger magnitude into NaN on some devices."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(FP8)


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
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads  # this rank's share
        self.head_dim = head_dim
        self.dtype = dtype  # the model's: what attention computes in
        self.cache_dtype = cache_dtype or dtype  # what the buffers hold
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: a padded gather may read a never-written slot (it is masked out,
        # but NaN garbage times a zero weight would still poison the sum). On the CPU on huge
        # pages: decode attention streams every layer's buffers each step.
        held = self.cache_dtype
        self.k_buffers = [hugepages.zeros(shape, held, device) for _ in range(num_layers)]
        self.v_buffers = [hugepages.zeros(shape, held, device) for _ in range(num_layers)]

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == FP8

    def store(
        self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s K and V rows at `slots` [T] = k, v [T, Hkv, D]. Returns them as
        the cache gives them back (k and v themselves, or an fp8 cache's rounded values): what
        attention over this step's own rows must read where it takes them from the step rather
        than from the buffers, so that every query sees the same keys and values. On CPU one
        pass of row copies (or roundings) from where k and v lie (views of the fused qkv
        output; index_copy_ from such strided views goes element by element: ~3% of a CPU
        prefill step)."""
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if self.fp8:
            if cpu_kernels.kv_store_supported(k_buf, k, v):
                return cpu_kernels.kv_store_fp8(k_buf, v_buf, slots, k, v)
            kq, vq = to_fp8(k), to_fp8(v)  # index_copy_ has no float8 kernels: the bytes
            k_buf.view(torch.uint8).index_copy_(0, slots, kq.view(torch.uint8))
            v_buf.view(torch.uint8).index_copy_(0, slots, vq.view(torch.uint8))
            return self.dequantize(kq), self.dequantize(vq)
        if cpu_kernels.kv_store_supported(k_buf, k, v):
            cpu_kernels.kv_store(k_buf, v_buf, slots, k, v)
        else:
            k_buf.index_copy_(0, slots, k)
            v_buf.index_copy_(0, slots, v)
        return k, v

    def dequantize(self, t: torch.Tensor) -> torch.Tensor:
        """Rows read from the buffers, in the model's dtype."""
        return t.to(self.dtype) if t.dtype != self.dtype else t

    def read(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rows `slots` of one of the buffers, in the model's dtype."""
        return self.dequantize(gather(buf, slots))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element
