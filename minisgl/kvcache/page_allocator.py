"""Free-page allocator for the paged KV cache (torch-free bookkeeping)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class OutOfPagesError(RuntimeError):
    """Raised by `PageAllocator.alloc` when fewer pages are free than asked for."""


class PageAllocator:
    """Hands out page ids in [0, num_pages) and takes them back.

    `alloc` raises `OutOfPagesError` when short (callers check `num_free` first, or evict and
    retry); `free` raises `ValueError` on a double free or an id it never handed out, because a
    page freed twice would later be handed to two requests and silently corrupt their KV.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # A stack: recently freed pages are reused first (warm in caches on the device).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = np.zeros(num_pages, dtype=np.bool_)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def is_allocated(self, page: int) -> bool:
        return bool(self._in_use[page])

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        pages.reverse()  # ascending on a fresh pool: neighbouring pages, friendlier gathers
        del self._free[-n:]
        self._in_use[pages] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if not pages:
            return
        arr = np.asarray(pages, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= self.num_pages:
            raise ValueError(f"page id out of range [0, {self.num_pages}): {pages}")
        # Check everything before changing anything, so a bad call leaves the allocator intact.
        if len(np.unique(arr)) != len(arr) or not self._in_use[arr].all():
            bad = sorted({p for p in pages if not self._in_use[p]} | _repeated(pages))
            raise ValueError(f"double free of pages {bad}")
        self._in_use[arr] = False
        self._free.extend(pages)


def _repeated(pages: list[int]) -> set[int]:
    seen: set[int] = set()
    out: set[int] = set()
    for p in pages:
        if p in seen:
            out.add(p)
        seen.add(p)
    return out
