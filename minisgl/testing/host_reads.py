"""Counting the places where Python reads a tensor's values back: on a GPU each is a
device->host copy that waits for all queued work (a sync), so a step's count is what its
overlap of host and device depends on. Works on any device, the CPU included, because it
counts the calls, not the copies."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand values to Python (or a host array), plus ops known to sync inside
# (torch.bincount on CUDA reads the input's min and max to size its result).
READS = frozenset(
    {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"}
)
SYNCING_OPS = frozenset({"bincount", "nonzero", "unique", "masked_select", "repeat_interleave"})


class HostReads(TorchFunctionMode):
    """`with HostReads() as reads: ...`, then `reads.count` (reads), `reads.calls` (each kind)
    and `reads.syncing_ops` (ops that sync inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.syncing_ops: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and _to_host(args, kwargs or {})):
            self.calls[name] += 1
        elif name in SYNCING_OPS:
            self.syncing_ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.calls.values())


def _to_host(args: Any, kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
