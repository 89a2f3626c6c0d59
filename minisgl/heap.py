"""Keep the memory a CPU step frees for the next step instead of handing it back to the kernel.

glibc's malloc serves a large allocation (from 128 KiB; its threshold rises with what is freed,
to 32 MiB at most) with a mapping of its own and unmaps it at free, and it returns the heap's
free top to the kernel once more than twice that threshold lies there. A CPU step's
temporaries (activations, the MLP's [T, 2I] product: ~50 MB a layer in a 4096-token prefill)
are all of that size: every step maps them again and the kernel faults in and zeroes each
4 KiB page anew. Measured on a 2-core Intel Xeon (Sapphire Rapids, KVM; avx512_bf16, amx),
Qwen3-0.6B shape, bf16, a 3840-token prefill (320 tokens a request): ~594,000 page faults a step
over 28 layers; with 4 layers and one thread, 58,000-80,000 faults and 0.17-0.21 s of kernel
time a step before, none and 0.02 s after (a shared machine: CPU times, not wall). With the heap
kept (`keep_freed_memory`) the faults stop after the first step or two of a size, and the
process keeps what its steps freed: there, RSS after two such prefills 1100 MB against 1025 MB
(75 MB more; the weights and KV cache are ~990 MB).

Called once the weights are in place (model_runner.py), it first hands back what loading freed
(checkpoint buffers, weights moved onto huge pages, quantization temporaries): glibc's rising
mmap threshold had put many of those in the heap, where a freed block below the top stays
resident (`malloc_trim` releases such holes). Measured on the same Xeon, a Qwen3-30B-A3B-shaped
GPTQ-Int4 model (17.4 GB of weights): scheduler RSS - weights - KV 2.04 GB without the trim,
0.39 GB with it (`benchmarks/big_moe_memory.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt takes an int: the largest trim threshold it can be told (2 GiB: never, in effect,
# since a step frees its temporaries from the heap's middle as much as from its top).
_NEVER_TRIM = 2**31 - 1

_KEPT = False


def _glibc() -> Any:
    """glibc, or None (another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt as a no-op stub)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def keep_freed_memory() -> bool:
    """From now on, large allocations come from the heap (no mapping of their own) and freed
    heap memory stays with the process; True where that applied (glibc), False elsewhere."""
    global _KEPT
    if _KEPT:
        return True
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)  # every whole free page of the heap back to the kernel first
    _KEPT = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    )
    if _KEPT:
        logger.info("CPU steps reuse the memory they free (malloc: no unmapping, no trimming)")
    return _KEPT
