"""Random quantized weights for the kernel tests."""

from __future__ import annotations

import torch

from minisgl.quant.qtensor import QTensor, pack_nibbles


def random_qtensor(n: int, k: int, bits: int, group: int, seed: int = 0) -> QTensor:
    """Random integer codes, scales and zero points, N x K (group 0: one per row)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    codes = pack_nibbles(q) if bits == 4 else q
    scales = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g, dtype=torch.uint8)
    return QTensor(codes, scales, zeros, None, bits, group, k)
