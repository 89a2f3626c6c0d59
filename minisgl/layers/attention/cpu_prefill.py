"""Prefill attention on bf16 dot-product hardware (csrc/attention.c, prefill_attn).

The kernel reads the step's q, k and v where the qkv projection left them (row views, heads
packed in a row): a prompt's new tokens attend over their own K/V rows as they lie in the
step, and only a cached prefix is read from the pool (by slot); it writes each prompt's rows
of the step's output in place. torch's CPU flash kernel ran this at about a third of the
speed the same tiles reach in a matmul (Qwen3-0.6B heads, 128-token prompts: 11% of a prefill
step for ~2% of its arithmetic). It runs on AMX tiles where the CPU and the build have
AMX-BF16, else on AVX512-BF16's VDPBF16PS over the same packed blocks (AMD EPYC Zen 4,
avx512f/bw/vl, avx512_bf16, avx512_vnni, no AMX; Qwen3-0.6B heads, 1 thread, CPU time: 0.23x
SDPA's time for a 512-token prompt, 0.29x for four of 128; a whole 512-token prefill step
0.79x), for bf16 and head dims 64 or 128; elsewhere (the AVX2 build, a CPU without
AVX512-BF16) and with MINISGL_CPU_PREFILL_ATTN=0 (benchmarks) the backend keeps SDPA.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from minisgl.layers import cpu_kernels

# Longest prompt the kernel takes (its row buffers; csrc/attention.c PREFILL_MAX_LEN).
MAX_LEN = 8192


@cache
def _lib() -> Any:
    """The loaded kernel build (dlopen: the same handle), or None."""
    if cpu_kernels.load() is None or cpu_kernels._LIB_PATH is None:
        return None
    return ctypes.CDLL(str(cpu_kernels._LIB_PATH))


def form() -> int:
    """The form a call takes here: 2 AMX tiles, 1 VDPBF16PS, 0 none."""
    lib = _lib()
    return int(lib.prefill_attn_form()) if lib is not None else 0


def _switch(name: str) -> ctypes.c_int | None:
    """A global int of the kernel's build (None: no build loaded)."""
    lib = _lib()
    return None if lib is None else ctypes.c_int.in_dll(lib, name)


def pick() -> ctypes.c_int | None:
    """The kernel's switch for tests and benchmarks: the most capable form a call may take
    (2 AMX, 1 VDPBF16PS, 0 none: attend returns False)."""
    return _switch("prefill_attn_pick")


def pairs() -> ctypes.c_int | None:
    """The AMX form's switch for tests: 1 (the default) an item takes two 16-row query blocks
    at once, 0 one; the bits are the same."""
    return _switch("prefill_attn_pairs")


@cache
def _kernel() -> Any:
    """The C entry point, or None where the kernels or either form are not available."""
    if os.environ.get("MINISGL_CPU_PREFILL_ATTN", "1") in ("0", "false", "no"):
        return None
    lib = _lib()
    if lib is None or not lib.prefill_attn_form():
        return None
    fn = lib.prefill_attn
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    args: list[Any] = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    fn.argtypes = args + [ctypes.c_float, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


def available(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether fresh prompts of this attention shape can run on the kernel here."""
    return (
        dtype == torch.bfloat16
        and head_dim in (64, 128)
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and _kernel() is not None
    )


def _rows_ok(x: torch.Tensor) -> bool:
    """[T, H, D] with each row's heads packed (a view of a wider row is fine)."""
    return x.device.type == "cpu" and x.stride(2) == 1 and x.stride(1) == x.shape[2]


@dataclass
class Plan:
    """A step's prompts for the kernel (int64 tensors)."""

    rows: torch.Tensor  # [3, n]: each prompt's first step row, first output row, new tokens
    prefix: torch.Tensor | None  # [2, n]: cached prefix length, its first index in `slots`
    slots: torch.Tensor | None  # the prefixes' pool slots, prompt after prompt


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: Plan,
    out: torch.Tensor,
    scale: float,
) -> bool:
    """q [T, Hq, D], k/v [T, Hkv, D] (bf16): the step's new tokens; k_pool/v_pool [S, Hkv, D]:
    the layer's cache, where cached prefixes are read. Writes the planned prompts' rows of
    `out` [*, Hq * D]; False where the kernel cannot take these tensors (nothing written:
    the caller falls back)."""
    fn = _kernel()
    if fn is None or not all(map(_rows_ok, (q, k, v, k_pool, v_pool))):
        return False
    if not all(x.dtype == torch.bfloat16 for x in (q, k, v, k_pool, v_pool, out)):
        return False
    _, hq, d = q.shape
    if out.device.type != "cpu" or out.stride(1) != 1 or out.shape[1] != hq * d:
        return False
    if k_pool.stride(0) != v_pool.stride(0) or k_pool.shape[1:] != k.shape[1:]:
        return False
    rows, pre = plan.rows, plan.prefix
    done = fn(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        rows[0].data_ptr(),
        rows[1].data_ptr(),
        rows[2].data_ptr(),
        rows.shape[1],
        hq,
        k.shape[1],
        d,
        scale,
        out.data_ptr(),
        out.stride(0),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        k_pool.stride(0),
        None if pre is None else pre[0].data_ptr(),
        None if pre is None else pre[1].data_ptr(),
        None if plan.slots is None else plan.slots.data_ptr(),
    )
    return bool(done)
