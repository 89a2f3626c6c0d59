"""A step's paged-KV description in FlashInfer's terms, built on the host from the scheduler's
lists.

FlashInfer's `plan()` reads its index arrays on the CPU: handed device tensors, it copies each
back to the host, and every such copy waits for the GPU to finish the work queued before it
(three stalls per step). Built here as CPU tensors, plan() reads them in place and uploads
what the kernels need itself; pinned, those uploads do not wait either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.layers.attention.base import BatchLayout, check_page_tables


@dataclass
class PagedPlan:
    """plan()'s index arguments (int32 CPU tensors) plus the new tokens' pool slots."""

    qo_indptr: torch.Tensor  # [B + 1] where each request's new tokens start in the step
    kv_indptr: torch.Tensor  # [B + 1] where each request's pages start in `indices`
    indices: torch.Tensor  # [sum pages] the pages of every request, in order
    last_page_len: torch.Tensor  # [B] tokens in each request's last page (1..page_size)
    out_loc: np.ndarray  # [T] int64 pool slot of each new token


def build_paged_plan(layout: BatchLayout, pin: bool = False) -> PagedPlan:
    """The step's plan() inputs from plain lists (no device work, so no device sync); `pin`
    puts the index arrays in page-locked memory (CUDA only) so their uploads run async."""
    ps = layout.page_size
    prefix = np.asarray(layout.prefix_lens, dtype=np.int64)
    extend = np.asarray(layout.extend_lens, dtype=np.int64)
    total = prefix + extend
    used_pages = (total + ps - 1) // ps
    check_page_tables(layout)  # as the torch backend: never attend to a stray page
    indices = np.concatenate(
        [np.asarray(t[:n], dtype=np.int64) for t, n in zip(layout.page_tables, used_pages)]
        or [np.zeros(0, dtype=np.int64)]
    )
    qo_indptr = np.concatenate(([0], np.cumsum(extend)))
    kv_indptr = np.concatenate(([0], np.cumsum(used_pages)))
    last_page_len = total - (used_pages - 1) * ps
    # Slots of the new tokens: page of position p, offset within it.
    req = np.repeat(np.arange(len(extend)), extend)
    pos = np.arange(int(extend.sum())) - qo_indptr[req] + prefix[req]
    out_loc = indices[kv_indptr[req] + pos // ps] * ps + pos % ps

    def host(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
        return t.pin_memory() if pin else t

    return PagedPlan(host(qo_indptr), host(kv_indptr), host(indices), host(last_page_len), out_loc)


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`: from page-locked memory without blocking on CUDA (torch's
    pinned allocator keeps the buffer until the copy is done), a plain copy elsewhere."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
