"""The CPU decode attention kernel over fp8 e4m3 pools (--kv-cache-dtype fp8): keys and values
widened exactly as it reads them, and the step's new rows rounded into the pool with the bits
torch's cast gives (kv_pool.to_fp8), for every bf16 value."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache.kv_pool import FP8, to_fp8
from minisgl.layers import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="the CPU kernels do not build here"
)


def _reference(q, k8, v8, slots, lens) -> torch.Tensor:  # noqa: ANN001
    b, hq, d = q.shape
    hkv = k8.shape[1]
    out = []
    for i in range(b):
        s = slots[i, : lens[i]]
        keys, values = k8[s].float(), v8[s].float()
        qi = q[i].float().view(hkv, hq // hkv, d)
        w = (torch.einsum("hgd,khd->hgk", qi, keys) * d**-0.5).softmax(-1)
        out.append(torch.einsum("hgk,khd->hgd", w, values).reshape(-1))
    return torch.stack(out)


# Head dims: multiples of 16 on 16 lanes in the AVX-512 build, 72 on 8
@pytest.mark.parametrize("heads", [(16, 8, 128), (4, 2, 64), (8, 8, 72), (16, 2, 128), (6, 2, 80)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["default", "8-lane"])
def test_matches_attention_over_the_widened_pool(
    heads: tuple[int, int, int], q_dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way the kernel widens the codes (the switch turns the 16-lane passes off)."""
    lib = cpu_kernels._loaded()
    assert lib is not None
    if lib.attn_e4m3_512 is not None:
        monkeypatch.setattr(lib.attn_e4m3_512, "value", int(path == "default"))
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(hq * d)
    k8, v8 = (to_fp8(torch.randn(400, hkv, d, generator=gen) * 3) for _ in range(2))
    assert cpu_kernels.supports_decode_attention(k8, hq)
    b = 7
    q = torch.randn(b, hq, d, generator=gen).to(q_dtype)
    lens = torch.tensor([1 + (37 * i) % 300 for i in range(b)], dtype=torch.int64)
    slots = torch.stack([torch.randperm(400, generator=gen)[: int(lens.max())] for _ in range(b)])
    got = cpu_kernels.decode_attention(q, k8, v8, slots, lens, d**-0.5)
    assert got.dtype == q_dtype
    tol = 1e-4 if q_dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.float(), _reference(q, k8, v8, slots, lens), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_new_rows_are_rounded_as_torch_rounds_them(dtype: torch.dtype) -> None:
    """Every finite bf16 value (in fp32 rows too), ties, subnormals and values past 448."""
    hq, hkv, d = 4, 2, 128
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[~every.isnan()].to(dtype)
    rows = every[: every.numel() // (hkv * d) * hkv * d].view(-1, hkv, d)
    if dtype == torch.float32:  # fp32 values between bf16 ones: ties and just past them
        rows = rows * (1 + 2.0**-9) + torch.randn(rows.shape) * 2.0**-12
    for at in range(0, rows.shape[0], 64):
        k = rows[at : at + 64]
        n = k.shape[0]
        k_pool = torch.zeros(n + 3, hkv, d, dtype=FP8)
        v_pool = torch.zeros_like(k_pool)
        new = torch.arange(n, dtype=torch.int64) + 3
        q = torch.zeros(n, hq, d, dtype=dtype)
        lens = torch.ones(n, dtype=torch.int64)
        cpu_kernels.decode_attention(
            q, k_pool, v_pool, new[:, None].clone(), lens, 0.1, (k, -k, new)
        )
        assert torch.equal(k_pool[3:].view(torch.uint8), to_fp8(k).view(torch.uint8))
        assert torch.equal(v_pool[3:].view(torch.uint8), to_fp8(-k).view(torch.uint8))
