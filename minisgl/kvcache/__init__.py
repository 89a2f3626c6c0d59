"""KV cache bookkeeping: page allocator and radix prefix cache (torch-free).

The tensor page pool lives in `minisgl.kvcache.kv_pool` and is imported from there explicitly,
so that importing this package never pulls in torch.
"""

from minisgl.kvcache.page_allocator import OutOfPagesError, PageAllocator
from minisgl.kvcache.radix_cache import InsertResult, MatchResult, RadixCache, RadixNode

__all__ = [
    "InsertResult",
    "MatchResult",
    "OutOfPagesError",
    "PageAllocator",
    "RadixCache",
    "RadixNode",
]
