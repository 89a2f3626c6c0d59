"""Faster CPU matmuls for decode-shaped inputs (a handful of rows against a large weight).

`F.linear` on CPU streams weights at a fraction of memory bandwidth for small batches (MKL's
small-M path, and torch's bf16 path without AVX-512). Two remedies, in order of preference:
- our AVX2 kernels (cpu_kernels.py): a GEMV for up to MAX_ROWS rows (memory-bound decode)
  and a blocked GEMM beyond (batched decode, prefill). Both compute in fp32 from bf16 weights:
  without native bf16 (AVX2), torch's bf16 matmul runs ~10x below its fp32 one;
- else oneDNN with the weight reordered once into its blocked layout, for every row count
  (needs CPU support for the dtype: bf16 wants AVX-512 or AVX-NE-CONVERT).
On CPUs with native bf16 dot products (AVX512-BF16, AMX) oneDNN's bf16 GEMM does twice the
FLOPs per instruction of our fp32-compute one, so there bf16 layers keep both: our GEMV for
decode-sized inputs (bandwidth-bound, where it streams faster) and a oneDNN-packed copy for
more rows (compute-bound: prefill, big decode batches). That costs a second copy of the bf16
weights; MINISGL_CPU_ONEDNN_GEMM=0 drops it.
Where nothing applies `create` returns None and the layer keeps F.linear.

The switch: MINISGL_CPU_PREPACK=0 turns all of this off (plain F.linear everywhere);
MINISGL_CPU_KERNELS=0 turns off just the AVX2 kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels


def prepack_enabled() -> bool:
    return os.environ.get("MINISGL_CPU_PREPACK", "1") not in ("0", "false", "no")


def native_bf16() -> bool:
    """The CPU has bf16 dot-product instructions (oneDNN's fast bf16 path)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def onednn_gemm_enabled() -> bool:
    return os.environ.get("MINISGL_CPU_ONEDNN_GEMM", "1") not in ("0", "false", "no")


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        # Probe once: some builds reorder fine but refuse the matmul for this dtype.
        _onednn_linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed)
    except (RuntimeError, AttributeError):
        return None
    return packed


class CpuLinearKernel:
    """y = x @ weight.T (in `out_dtype`, default x's dtype) by the fastest available path."""

    def __init__(
        self,
        weight: torch.Tensor,
        use_gemv: bool,
        packed: torch.Tensor | None,
        out_dtype: torch.dtype | None,
    ) -> None:
        self.weight = weight
        self.use_gemv = use_gemv
        self.packed = packed
        self.out_dtype = out_dtype

    @staticmethod
    def create(
        weight: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> CpuLinearKernel | None:
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        if not prepack_enabled():
            return None
        weight = weight.detach()
        if cpu_kernels.supports(weight):
            # Many rows go to oneDNN where the CPU multiplies bf16 natively (see above).
            big = (
                _onednn_pack(weight)
                if weight.dtype == torch.bfloat16 and native_bf16() and onednn_gemm_enabled()
                else None
            )
            return CpuLinearKernel(weight, True, big, out_dtype)
        packed = _onednn_pack(weight)
        if packed is None:
            return None
        return CpuLinearKernel(weight, False, packed, out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gemv:
            if x.shape[0] <= cpu_kernels.MAX_ROWS:
                return cpu_kernels.gemv(x, self.weight, self.out_dtype)
            if self.packed is None:
                return cpu_kernels.gemm(x, self.weight, self.out_dtype)
        if self.packed is not None:
            y = _onednn_linear(x, self.packed)
        else:
            y = F.linear(x, self.weight)
        return y if self.out_dtype is None else y.to(self.out_dtype)
