"""The torch attention backend's memory for a long chunk after a cached prefix is bounded by
the chunk, not by chunk x keys x heads (a 32k-token prompt must fit wherever its KV cache fits).

Peak allocation is read from torch's profiler: with profile_memory on, the CPU allocator
reports every allocation and free made while profiling (frees of older blocks are not
reported), so the running sum of those sizes is the live memory the call added, and its
maximum the peak. That counts the buffers kernels allocate inside themselves too."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention import create_attention_backend
from minisgl.layers.attention.base import BatchLayout
from minisgl.layers.attention.torch_backend import TorchAttentionBackend

PREFIX, CHUNK = 3072, 1024  # a chunk against 4096 keys
D, PAGE = 8, 16


def peak_bytes(fn: object) -> int:
    """The most memory `fn()` held at once beyond what existed before it ran."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_counts_what_is_held() -> None:
    """The measure itself: two live buffers count together, a freed one stops counting."""

    def work() -> None:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        del a, b
        torch.empty(1 << 20, dtype=torch.uint8)

    assert 3 << 20 <= peak_bytes(work) < (3 << 20) + 65536


@pytest.mark.parametrize(
    ("path", "heads"), [("cpu", (24, 4)), ("blocked", (16, 2))], ids=["cpu", "blocked"]
)
def test_long_chunk_after_prefix_is_bounded_by_the_chunk(path: str, heads: tuple[int, int]) -> None:
    """ "cpu": the CPU defaults (SDPA's flash kernel, one query tile's mask at a time);
    "blocked": the online-softmax tiles that serve masked calls on CUDA, given a small budget
    (their default, 64 MiB of scores per tile, suits a GPU)."""
    HQ, HKV = heads  # noqa: N806
    keys = PREFIX + CHUNK
    pages = -(-keys // PAGE)
    pool = KVPool(1, pages, PAGE, HKV, D, torch.float32, "cpu")
    attn = create_attention_backend("torch", pool, HQ, HKV, D, D**-0.5)
    assert isinstance(attn, TorchAttentionBackend)
    attn.sdpa_mask_cells, attn.sdpa_q_tile_min = 1 << 20, 256  # 4 MiB of float32 mask
    if path == "blocked":
        attn.sdpa_masked = attn.sdpa_plain = False
        attn.tile_cells = 1 << 18  # one tile's scores: 1 MiB
    g = torch.Generator().manual_seed(0)
    pool.k_buffers[0].normal_(generator=g)
    pool.v_buffers[0].normal_(generator=g)
    q, k, v = (torch.randn(CHUNK, h, D, generator=g) for h in (HQ, HKV, HKV))
    layout = BatchLayout(PAGE, [PREFIX], [CHUNK], [list(range(pages))])
    out: list[torch.Tensor] = []
    peak = peak_bytes(lambda: out.append(attn.forward(q, k, v, 0, attn.prepare(layout))))
    scores = CHUNK * keys * HQ * 4  # every score of the chunk in float32: 256-384 MiB
    assert peak < scores // 32, f"{peak / 2**20:.1f} MiB"
    # Still the right answer: the last query sees every key.
    kk = pool.k_buffers[0].repeat_interleave(HQ // HKV, 1)
    vv = pool.v_buffers[0].repeat_interleave(HQ // HKV, 1)
    w = torch.einsum("hd,khd->hk", q[-1], kk[:keys]).mul(D**-0.5).softmax(-1)
    want = torch.einsum("hk,khd->hd", w, vv[:keys]).reshape(-1)
    torch.testing.assert_close(out[0][-1], want, atol=1e-4, rtol=1e-4)
