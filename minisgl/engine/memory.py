"""How many KV pages fit: derived from free memory and the context length, and, under tensor
parallelism, agreed by every rank before any scheduler is built."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from minisgl import distributed

logger = logging.getLogger(__name__)

# On CPU the pool shares RAM with the weights, the workers and whatever else runs on the box;
# take a modest share of what is available.
_CPU_SHARE = 0.4


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * _CPU_SHARE)
    except OSError:
        pass
    return 4 << 30


def default_num_pages(
    *,
    bytes_per_page: int,
    page_size: int,
    max_seq_len: int,
    max_running_requests: int,
    memory_fraction: float,
    device: torch.device,
) -> int:
    """Fill `memory_fraction` of free memory, but never more than every running request at
    full context could use, and always enough for one request at full context."""
    budget = int(available_bytes(device) * memory_fraction) // bytes_per_page
    pages_per_seq = math.ceil(max_seq_len / page_size)
    useful = pages_per_seq * max_running_requests
    return max(min(budget, useful), pages_per_seq + 1)


def agree_num_pages(local: int) -> int:
    """The pool size every tensor-parallel rank (on every node) builds: the least any of them
    can hold. Each rank schedules the same batches on its own pool, so pools of different sizes
    would admit different batches and line the ranks' collectives up wrong (a hang, or wrong
    outputs); GPUs' free memory differs by a few MiB routinely. One rank: `local`."""
    size = distributed.get_tp_size()
    if size == 1:
        return local
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    on_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine)
    figures = [int(f) for f in torch.cat(parts).tolist()]
    agreed = min(figures)
    if distributed.get_tp_rank() == 0 and len(set(figures)) > 1:
        logger.info(
            "KV cache: the ranks can hold %s pages (rank order); every rank builds %d",
            ", ".join(map(str, figures)),
            agreed,
        )
    return agreed
