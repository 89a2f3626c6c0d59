"""Fresh prompts' causal attention on AMX tiles (csrc/attention.c, prefill_attn_amx).

For prompts without a cached prefix the keys are the step's own K/V rows: the kernel reads
q, k and v where the qkv projection left them (row views, heads packed in a row) and writes
each prompt's rows of the output. torch's CPU flash kernel ran this at about a third of the
speed the same tiles reach in a matmul (Qwen3-0.6B heads, 128-token prompts: 11% of a prefill
step for ~2% of its arithmetic). Only where the CPU and the build have AMX-BF16, for bf16 and
head dims 64 or 128; elsewhere the backend keeps SDPA.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

from minisgl.layers import cpu_kernels

# Longest prompt the kernel takes (its row buffers; csrc/attention.c PREFILL_MAX_LEN).
MAX_LEN = 8192


@cache
def _kernel() -> Any:
    """The C entry point, or None where the kernels or AMX are not available."""
    if cpu_kernels.load() is None or cpu_kernels._LIB_PATH is None:
        return None
    lib = ctypes.CDLL(str(cpu_kernels._LIB_PATH))  # the loaded build (dlopen: the same handle)
    if not lib.amx_available():
        return None
    fn = lib.prefill_attn_amx
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    args: list[Any] = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    fn.argtypes = args + [ctypes.c_float, ptr, i64]
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> bool:
    """q [T, Hq, D], k/v [T, Hkv, D] (bf16); seqs [3, n] int64: each prompt's first step row,
    first row of `out` [*, Hq * D] and length. Writes those rows of `out`; False where the
    kernel cannot take these tensors (nothing written: the caller falls back)."""
    fn = _kernel()
    if fn is None or not all(map(_rows_ok, (q, k, v))):
        return False
    if not (q.dtype == k.dtype == v.dtype == out.dtype == torch.bfloat16):
        return False
    _, hq, d = q.shape
    if out.device.type != "cpu" or out.stride(1) != 1 or out.shape[1] != hq * d:
        return False
    done = fn(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        seqs[0].data_ptr(),
        seqs[1].data_ptr(),
        seqs[2].data_ptr(),
        seqs.shape[1],
        hq,
        k.shape[1],
        d,
        scale,
        out.data_ptr(),
        out.stride(0),
    )
    return bool(done)
