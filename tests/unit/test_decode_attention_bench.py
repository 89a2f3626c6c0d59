"""benchmarks/decode_attention.py: the C decode attention alone, against torch's SDPA on the
same pools and the read loop over as many bytes."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from minisgl.layers import cpu_kernels

TINY = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--context", "19"]
TINY += ["--page-size", "4", "--repeats", "2", "--read-mb", "8"]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no CPU kernels to time")
def test_it_times_the_kernel_cold_and_cached_against_sdpa(
    import_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = import_benchmark("decode_attention")
    assert bench.main([*TINY, "--batches", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "read loop:" in out
    # 3 requests x 19 keys x 2 layers x (keys + values) x 2 heads x 32 dims x 2 bytes
    assert "B=3 x 19 keys, 2 layers, bf16 pools (pages of 4, shuffled): 0.0 MB" in out
    for case in ("C kernel, cold", "C kernel, cached", "torch SDPA, cold"):
        assert out.count(case) == 2, case
    assert "1.00x SDPA's speed" in out


def test_the_pools_hold_each_request_s_keys_on_whole_shuffled_pages(
    import_benchmark: Callable[[str], ModuleType],
) -> None:
    bench = import_benchmark("decode_attention")
    args = bench.argparse.Namespace(
        context=10, page_size=4, kv_heads=2, head_dim=32, kv_dtype="fp8", layers=3
    )
    pools = bench.make_pools(args, 5, torch.Generator().manual_seed(1))
    assert pools.slots.shape == (5, 10) and pools.lens.tolist() == [10] * 5
    assert len(pools.keys) == len(pools.values) == 3
    assert pools.keys[0].dtype == torch.float8_e4m3fn
    # Each request's keys: pages of 4 adjacent slots; no slot belongs to two requests.
    s = pools.slots
    assert torch.equal(s[:, :4] % 4, torch.arange(4).expand(5, 4))
    assert torch.equal(s[:, 1:4] - s[:, :3], torch.ones(5, 3, dtype=torch.int64))
    assert len(set(s.flatten().tolist())) == 50
    assert pools.nbytes == 2 * 3 * 5 * 10 * 2 * 32  # fp8: a byte a value


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no CPU kernels to time")
def test_a_kernel_that_answers_wrong_is_not_timed(
    import_benchmark: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = import_benchmark("decode_attention")
    right = bench.kernel_layer
    monkeypatch.setattr(bench, "kernel_layer", lambda *a: right(*a) + 1)
    with pytest.raises(AssertionError):
        bench.main([*TINY, "--batches", "2"])
