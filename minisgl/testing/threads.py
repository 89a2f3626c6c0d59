"""Run a computation at one thread and at several, for tests that a kernel sums every output
in one order whatever the thread count."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def at_thread_counts(fn: Callable[[], T]) -> list[T]:
    """fn() at 1 thread, then at max(torch's count, 2); torch's count restored after."""
    threads = torch.get_num_threads()
    out = []
    try:
        for count in (1, max(threads, 2)):
            torch.set_num_threads(count)
            out.append(fn())
    finally:
        torch.set_num_threads(threads)
    return out
