"""Tensor parallelism: every rank verifies the drafts rank 0 chose.

Every rank runs the same scheduler on the same requests, but only rank 0 has a drafter (a
draft head's output, or an adaptive draft length, could differ by a hair between processes;
ranks whose batches differed would line their collectives up wrong). So rank 0's drafts travel
to the others, once per step that has decoding requests, as one small integer tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from minisgl import distributed


def share_drafts(drafts: Sequence[Sequence[int]] | None, n: int, k: int) -> list[list[int]]:
    """Rank 0's drafts (n requests, at most k tokens each; None on the other ranks) on every
    rank. With one rank, rank 0's drafts as they are."""
    if distributed.get_tp_size() == 1:
        assert drafts is not None
        return [list(d) for d in drafts]
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    on_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    table = torch.zeros(n, k + 1, dtype=torch.int64)  # per request: length, then the tokens
    if distributed.get_tp_rank() == 0:
        assert drafts is not None and len(drafts) == n
        for i, d in enumerate(drafts):
            d = list(d)[:k]  # the table's width: every rank sized it from the same flag
            table[i, 0] = len(d)
            table[i, 1 : 1 + len(d)] = torch.tensor(list(d), dtype=torch.int64)
    table = table.to(device)
    dist.broadcast(table, src=0)
    rows = table.cpu().tolist()
    return [row[1 : 1 + row[0]] for row in rows]
