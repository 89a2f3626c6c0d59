"""How many KV pages fit: derived from free memory and the context length."""

from __future__ import annotations

import math

import torch

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
