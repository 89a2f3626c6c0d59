"""Record the kernel chooser's timing passes: which tensors each pass flushed out of the caches
(cpu_kernels.flush) before its clock reads, for tests that every pass reads from memory."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from minisgl.layers import cpu_kernels

if TYPE_CHECKING:
    import pytest


class Passes:
    """Patches cpu_kernels.flush to record each call (the data pointers flushed; it still
    flushes); `clock` is a chooser clock that records its reads, in the same order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, set[int]]] = []
        flush = cpu_kernels.flush

        def flushed(tensors: Iterable[torch.Tensor]) -> bool:
            ts = list(tensors)
            self.events.append(("flush", {t.data_ptr() for t in ts}))
            return flush(ts)

        monkeypatch.setattr(cpu_kernels, "flush", flushed)

    def clock(self) -> float:
        self.events.append(("clock", set()))
        return float(len(self.events))

    def each_flushed(self) -> bool:
        """Whether every timed pass (two clock reads) came right after a flush."""
        kinds = "".join("f" if kind == "flush" else "c" for kind, _ in self.events)
        return bool(kinds) and kinds == "fcc" * (len(self.events) // 3)

    def flushed(self) -> list[set[int]]:
        """The data pointers of each flush, in order."""
        return [ptrs for kind, ptrs in self.events if kind == "flush"]
