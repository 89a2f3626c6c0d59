"""Huge pages under the big CPU buffers (panel weights, KV cache): asked for, and harmless."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minisgl import hugepages
from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import cpu_kernels, cpu_linear
from minisgl.testing.smaps import huge_kb_under, thp_mode


def test_buffers_behave_like_torch_ones() -> None:
    z = hugepages.zeros((3, 5, 7), torch.bfloat16, "cpu")
    assert z.shape == (3, 5, 7) and z.dtype == torch.bfloat16 and not z.any()
    e = hugepages.empty(4, 6, dtype=torch.float32)
    assert e.shape == (4, 6) and e.dtype == torch.float32
    assert hugepages.empty(0, dtype=torch.float32).numel() == 0


def test_large_buffers_get_huge_pages_where_the_system_offers_them() -> None:
    t = hugepages.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)  # the first touch: where the kernel places the pages
    if thp_mode() in ("always", "madvise"):
        assert huge_kb_under(t.data_ptr() + (32 << 20)) >= 2048
    assert int(t[::4096].sum()) == t[::4096].numel()


def test_kv_pool_and_panel_weights_use_them() -> None:
    pool = KVPool(2, 256, 16, 8, 128, torch.bfloat16, "cpu")  # 8 MiB per buffer
    assert not pool.k_buffers[0].any()
    if not cpu_kernels.load():
        return
    w = torch.randn(4096, 1024, dtype=torch.bfloat16)
    packed = cpu_kernels.panel_pack(w)
    if thp_mode() in ("always", "madvise"):
        for t in (pool.k_buffers[1], packed.data):
            middle = t.data_ptr() + t.numel() * t.element_size() // 2
            assert huge_kb_under(middle) >= 2048


def test_row_major_weights_a_cpu_layer_keeps_move_onto_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The weights as loaded sit on small pages; the chooser puts the ones it times and keeps
    on huge pages, in place (a tied embedding sharing the Parameter follows), same values."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINISGL_CPU_LINEAR", raising=False)
    if not cpu_kernels.load():
        return
    w = torch.nn.Parameter(torch.randn(2048, 1024).bfloat16(), requires_grad=False)
    before, values = w.data_ptr(), w.detach().clone()
    layer = SimpleNamespace(weight=w, kernel_out_dtype=None, kernel=None)
    # Read elsewhere too (shared): the row-major weight is kept whatever the CPU's untimed
    # defaults are (on AVX512-BF16 without AMX they would keep only panels of it).
    cpu_linear.prepack_modules([layer], "off", shared={id(w)})
    assert layer.weight is w and torch.equal(w, values) and w.data_ptr() != before
    if thp_mode() in ("always", "madvise"):
        assert huge_kb_under(w.data_ptr() + w.numel()) >= 2048  # the middle of its 4 MiB
    x = torch.randn(1, 1024).bfloat16()
    assert layer.kernel is not None and torch.equal(layer.kernel(x), layer.kernel(x))


def test_views_and_small_tensors_stay_where_they_are() -> None:
    base = torch.zeros(4096, 1024)
    view = base[1024:]  # moving it would leave its base behind: a second copy
    small = torch.zeros(16, 16)
    for t in (view, small):
        ptr = t.data_ptr()
        hugepages.move_onto(t)
        assert t.data_ptr() == ptr


def test_small_tensors_share_one_mapping_of_huge_pages() -> None:
    """Tensors under 2 MB each (a small model's weights, scales beside their codes) moved
    together: one after another in one mapping, on a cache line each, values kept, the huge
    pages under them; a view and a repeat are left alone. Before, each stayed on small pages
    (move_onto skips what is under a huge page)."""
    ts = [torch.randn(300_000 + 7 * i) for i in range(8)]  # ~1.2 MB each
    ts.append(torch.randint(0, 255, (1000, 77), dtype=torch.uint8))
    values = [t.clone() for t in ts]
    view = torch.randn(1 << 20)[::2]
    view_ptr = view.data_ptr()
    hugepages.move_all_onto([*ts, ts[0], view])
    assert view.data_ptr() == view_ptr
    ptrs = [t.data_ptr() for t in ts]
    assert all(p % 64 == 0 for p in ptrs) and ptrs == sorted(ptrs)
    ends = [p + t.numel() * t.element_size() for p, t in zip(ptrs, ts, strict=True)]
    assert all(ptrs[i + 1] - ends[i] < 64 for i in range(len(ts) - 1))
    assert all(torch.equal(t, v) for t, v in zip(ts, values, strict=True))
    if thp_mode() in ("always", "madvise"):
        assert huge_kb_under(ptrs[4]) >= 2048
